"""What the caller can tell about the machine without importing torch or starting a process:
whether the engine will run on CUDA, whether OpenVINO is installed and computes bfloat16 here.
(The model families' backend rules ask these in the caller; core/families/.)"""

from __future__ import annotations

import importlib.util
import os
import shutil


def cuda_expected(device: str) -> bool:
    """Whether the engine will likely run on CUDA -- without importing torch in the caller."""
    if device.startswith("cuda") or device == "sim":  # the simulated device stands for a GPU
        return True
    if device != "auto" or os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def openvino_installed() -> bool:
    return importlib.util.find_spec("openvino") is not None


def openvino_cpu_has_bfloat16() -> bool:
    """Whether OpenVINO's CPU plugin computes in bfloat16 here (else it would silently run float32)."""
    import openvino

    return "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
