"""Executors that spread a job over many engines on Ray, and the readers that feed SAE training from a folder.

Ray is imported only when a job runs on it: `import nnrun.distributed` works without Ray installed
(`pip install "nnrun[distributed]"` adds it).
"""

from nnrun.distributed.cluster import RayExecutor
from nnrun.distributed.saelens import SaelensExport, export_saelens
from nnrun.distributed.token_dataset import TokenDataset

__all__ = ["RayExecutor", "SaelensExport", "TokenDataset", "export_saelens"]
