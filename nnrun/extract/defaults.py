"""Defaults that both `nnrun.extract` and `nnrun extract --help` show; importable without torch."""

DEFAULT_SHARD_TOKENS = 32768  # ~8 MB per module at H=128 fp32 ... 256 MB at H=4096 fp16
