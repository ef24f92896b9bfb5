"""vllmini.testing: the hypothesis strategies for sampler property tests, and the README's example."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import given, settings

from vllmini.engine.sampler import Sampler, SamplingTensors
from vllmini.testing import DTYPES, logits, sampler_batches, sampling_params

ROOT = Path(__file__).resolve().parents[1]
FAST = settings(deadline=None, max_examples=60)


def test_the_readme_example_runs_and_its_property_holds(tmp_path):
    """The example as a user's test file would hold it (hypothesis reads its test's source)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- sampler-property-example -->\n```python\n(.*?)```\n<!-- /sampler-property-example -->",
                      readme, re.S)  # fmt: skip
    assert block, "the README's sampler example is gone"
    path = tmp_path / "test_my_sampler.py"
    path.write_text(block.group(1))
    spec = importlib.util.spec_from_file_location("test_my_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tests = [f for name, f in vars(module).items() if name.startswith("test_")]
    assert len(tests) == 1
    tests[0]()  # hypothesis runs its examples; an assertion failing in one fails here


@FAST
@given(logits(max_rows=4, max_vocab=9))
def test_logits_rows_always_hold_a_finite_value(x):
    assert x.dtype in DTYPES and 1 <= x.shape[0] <= 4 and 1 <= x.shape[1] <= 9
    assert torch.isfinite(x.float()).any(-1).all()
    grid = x.float()[torch.isfinite(x.float())] * 8  # plain logits: exact eighths in [-20, 20]
    assert torch.equal(grid, grid.round()) and grid.abs().max() <= 160


@FAST
@given(logits(extreme=True, dtypes=(torch.float16,)))
def test_extreme_logits_stay_within_the_dtype(x):
    assert x.dtype == torch.float16 and not torch.isnan(x).any() and torch.isfinite(x.float()).any(-1).all()


@FAST
@given(sampling_params(seeded=False, greedy=False))
def test_sampling_params_respect_seeded_and_greedy(p):
    assert p.seed is None and not p.is_greedy


@FAST
@given(sampler_batches(max_vocab=7))
def test_sampler_batches_match_their_logits(batch):
    x, rows = batch
    assert len(rows) == x.shape[0]
    for row in rows:
        assert all(0 <= t < x.shape[1] for t in [*row.prompt_token_ids, *row.output_token_ids])
        assert row.params.seed is not None or row.params.is_greedy
    out = Sampler()(x, SamplingTensors.from_rows(rows, x.shape[1]))
    assert not out.invalid.any()


def test_importing_vllmini_does_not_need_hypothesis():
    code = "import sys, vllmini, vllmini.engine.sampler; assert 'hypothesis' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
