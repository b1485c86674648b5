"""ctxtrain: fine-tune diffusers video and image transformers under context parallelism."""

import logging

# Lines on every rank and every command that say nothing about the run, silenced before anything imports their
# sources (a package's __init__ runs before its modules): torchao (which transformers and diffusers import whenever
# it is installed; train/optim.py uses its optimizers) logs each CUDA kernel library it cannot load on a machine
# without one ("Failed to load ..._C_mxfp8...so"); torch notes torchao's enums as deprecated pytree constants; and
# diffusers 0.42.1 looks for torchao 0.18's tensor classes under an old path ("Unable to import `torchao` Tensor
# objects"), which matters only for loading a torchao-quantized checkpoint, which ctxtrain never does.
for _noisy in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
