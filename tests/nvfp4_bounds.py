"""Error bounds that follow from the arithmetic, for the NVFP4 tests (no tolerance measured on one machine)."""

import torch

U_BF16, U_FP32 = 2.0**-8, 2.0**-24  # unit roundoffs


def gemm_rounding_bound(x: torch.Tensor, w: torch.Tensor, y1: torch.Tensor, y2: torch.Tensor) -> torch.Tensor:
    """Largest difference two bf16 GEMMs ``y = x @ w^T`` of the same bf16 operands ``x`` [M, K], ``w`` [N, K] may
    show, elementwise [M, N].

    Each GEMM accumulates the K exact products in fp32 in its own order (oneDNN AMX, AVX512-BF16 or AVX2 blocking,
    or ATen's loop): error <= (K-1) u32 sum_k |x w| each; then rounds once to bf16: <= u16 |y| each. Denormal
    products flushed to zero (DAZ/FTZ in bf16 dot-product instructions) add at most K * 2**-126.
    """
    k = x.shape[-1]
    magnitude = x.float().abs() @ w.float().abs().t()
    return 2 * (k - 1) * U_FP32 * magnitude + U_BF16 * (y1.float().abs() + y2.float().abs()) + k * 2.0**-126
