"""``deepspeed.accelerator`` shim: CUDA when torch sees a GPU, else CPU (what DeepSpeed's tests query)."""

import torch


class _Accelerator:
    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()

    def device_name(self, device_index=None) -> str:
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def is_available(self) -> bool:
        return self._cuda

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor) -> bool:
        return bool(tensor.is_pinned()) if self._cuda else False

    def synchronize(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    @property
    def ByteTensor(self):
        if self._cuda:
            return lambda data: torch.tensor(data, dtype=torch.uint8, device="cuda")
        return torch.ByteTensor


_accelerator = None


def get_accelerator() -> _Accelerator:
    global _accelerator
    if _accelerator is None:
        _accelerator = _Accelerator()
    return _accelerator
