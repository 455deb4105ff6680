"""How Kubernetes tells GPU classes apart: NVIDIA GPU feature discovery (the GPU operator) labels each node
`nvidia.com/gpu.product=<the board's name>`, SXM and PCIe boards apart. Catalog names (kvserve/planner/gpus.py)
map to the boards that give the planner's memory figure."""

from __future__ import annotations

PRODUCT_LABEL = "nvidia.com/gpu.product"
PRESENT_LABEL = "nvidia.com/gpu.present"  # any NVIDIA GPU: for cards outside the catalog (--gpu-memory)
GPU_RESOURCE = "nvidia.com/gpu"

GPU_PRODUCTS: dict[str, tuple[str, ...]] = {
    "T4": ("Tesla-T4",),
    "A10": ("NVIDIA-A10", "NVIDIA-A10G"),
    "L4": ("NVIDIA-L4",),
    "RTX-3090": ("NVIDIA-GeForce-RTX-3090",),
    "RTX-4090": ("NVIDIA-GeForce-RTX-4090",),
    "A100-40GB": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"),
    "L40S": ("NVIDIA-L40S",),
    "RTX-A6000": ("NVIDIA-RTX-A6000",),
    "A100-80GB": ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
    "H100-80GB": ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"),
    "H200": ("NVIDIA-H200", "NVIDIA-H200-NVL"),
    "B200": ("NVIDIA-B200",),
}


def node_selector_expression(gpu_name: str) -> dict:
    """The node-affinity expression that lands an engine on this GPU class (any NVIDIA GPU when unknown)."""
    products = GPU_PRODUCTS.get(gpu_name)
    if products is None:
        return {"key": PRESENT_LABEL, "operator": "In", "values": ["true"]}
    return {"key": PRODUCT_LABEL, "operator": "In", "values": list(products)}


def overlay_name(gpu_name: str) -> str:
    """deploy/overlays/<name>: the catalog name in lower case (A100-80GB -> a100-80gb)."""
    return gpu_name.lower()
