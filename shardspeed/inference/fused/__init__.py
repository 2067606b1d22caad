"""Fused decoding (``replace_with_kernel_inject=True``): decoder blocks that run one QKV matmul,
one gate/up matmul, scaled-dot-product attention and a preallocated static KV cache written in
place, plus a greedy generation loop over them. Weights are the AutoTP/int8 model's own (the
fused matrices are built once and the model's projections become views into them).
"""
