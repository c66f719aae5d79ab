"""Compile options for the tests' block-kernel programs (passed to
`jax.jit(f).lower(...).compile(BLOCK_KERNEL_COMPILE)`).

XLA:CPU's LLVM code generation at -O0 (the HLO passes still run: half the
compile time), and its fusion emitters, which tests/conftest.py turns off
for the rest of the suite: the block kernel's many loops compile faster
through them. XLA:CPU's settings only: an accelerator compiles under its own.
"""
import jax

BLOCK_KERNEL_COMPILE = ({'xla_backend_optimization_level': 0, 'xla_cpu_use_fusion_emitters': True}
                        if jax.default_backend() == 'cpu' else {})
