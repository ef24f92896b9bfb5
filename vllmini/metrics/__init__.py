"""Engine metrics: the Prometheus registry each engine keeps (stat_logger.py) and its reader
(reader.py, vLLM's ``vllm.v1.metrics.reader``)."""
