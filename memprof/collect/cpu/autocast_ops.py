"""Which operators CUDA autocast runs in half precision and which in fp32, for telling from
an fp32 run what autocast would keep in bf16.

Autocast casts the inputs of its lower-precision list (matmuls, convolutions, fused
attention) to bf16 and runs them there, and runs its fp32 list (softmax, norms, losses,
``pow``, ``exp``, reductions) in fp32; any other operator runs in its inputs' dtype, fp32
where one of them is (``aten/src/ATen/autocast_mode.h``: ``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``). The lists name composite operators
too; these are the aten operators the storage tracker sees once they are decomposed.
"""

from __future__ import annotations

from memprof.collect.cpu.score_ops import aten_packets

LOWER_OPS = aten_packets(
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "addr", "convolution",
    "_convolution", "cudnn_convolution", "cudnn_convolution_transpose", "_prelu_kernel",
    "linear", "matmul", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
    "_efficient_attention_forward")
FP32_OPS = aten_packets(
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "native_layer_norm",
    "native_group_norm", "_fused_rms_norm", "nll_loss_forward", "nll_loss2d_forward",
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "binary_cross_entropy_with_logits", "_softmax", "_log_softmax", "cumsum", "cumprod",
    "prod", "sum", "logsumexp", "linalg_vector_norm", "norm", "dist", "_cdist_forward",
    "renorm", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
