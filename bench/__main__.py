"""``python -m bench ...``: the serving benchmark (bench.serving); ``vllmini bench`` is the same."""
from bench.serving import main

if __name__ == "__main__":
    main()
