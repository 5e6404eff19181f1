"""The model zoo: public architecture families as Flax NNX steps on synthetic data, each with a
GPU-sized default Config (an H200 train step of a few to ~20 ms, where the memory-bound work
matters) and a tiny QUICK one, in float32 or bfloat16 activations (parameters and optimizer state
stay float32).

Every module has the train examples' interface (examples/train_harness.py): `Config`, `QUICK`,
`make_init(c, seed)` -> a function giving `(graphdef, state)` of the model and its optimizer,
`make_batches(c, seed)` -> `batch(i)`, and a pure `train_step(graphdef, state, batch) -> (loss,
new_state)`. Three also have an inference variant: `make_infer_init(c, seed)` (the model alone, in
inference mode) and `infer_step(graphdef, state, batch) -> (loss, predictions)`, a forward pass
whose state is read, not donated.

    import zoo                       # with examples/ on sys.path
    m = zoo.MODELS["llama"]
    graphdef, state = m.make_init(m.quick(dtype="bfloat16"), 0)()
    loss, state = m.step(graphdef, state, m.make_batches(m.quick(), 0)(0))

scripts/zoo.py runs them all under jax.jit and jaxstitch.jit.
"""
from __future__ import annotations

import dataclasses
from types import ModuleType

from . import conformer, convnext, dlrm, llama, mamba, mixer, resnet, t5, unet, vit


@dataclasses.dataclass(frozen=True)
class Model:
    """One zoo entry: a family's module, as a train step or (`inference`) a forward pass."""

    name: str
    family: str
    module: ModuleType
    inference: bool = False

    def config(self, **changes):
        """The GPU-sized Config, with `changes` (e.g. dtype="bfloat16")."""
        return dataclasses.replace(self.module.Config(), **changes)

    def quick(self, **changes):
        """The tiny QUICK Config (CPU tests, smoke runs), with `changes`."""
        return dataclasses.replace(self.module.QUICK, **changes)

    def make_init(self, c, seed: int):
        return (self.module.make_infer_init if self.inference else self.module.make_init)(c, seed)

    def make_batches(self, c, seed: int):
        return self.module.make_batches(c, seed)

    @property
    def step(self):
        """`step(graphdef, state, batch)`: (loss, new state) for training, (loss, predictions) for
        inference."""
        return self.module.infer_step if self.inference else self.module.train_step


_ENTRIES = [
    Model("resnet", "BatchNorm ResNet-18 (CIFAR, NHWC)", resnet),
    Model("convnext", "ConvNeXt-T blocks (depthwise 7x7, LayerNorm, GELU MLP, layer scale)", convnext),
    Model("unet", "diffusion U-Net (GroupNorm, SiLU, time embedding, spatial attention)", unet),
    Model("llama", "Llama decoder (RMSNorm, GQA, RoPE, SwiGLU)", llama),
    Model("t5", "T5 encoder (relative position buckets, RMS LayerNorm, gated GELU, Adafactor)", t5),
    Model("mamba", "Mamba selective state-space scan (lax.scan)", mamba),
    Model("dlrm", "DLRM recommender (embedding bags, dot interaction, BCE)", dlrm),
    Model("conformer", "Conformer (half-step FFNs, attention, GLU + depthwise conv + BatchNorm)", conformer),
    Model("resnet_infer", "ResNet-18 forward (running statistics)", resnet, inference=True),
    Model("llama_infer", "Llama forward (prefill, next-token predictions)", llama, inference=True),
    Model("convnext_infer", "ConvNeXt-T forward", convnext, inference=True),
    Model("vit", "ViT-S/16 (pre-LayerNorm, exact GELU, dropout, class token, global-norm clipping)", vit),
    Model("mixer", "MLP-Mixer-S/16 (token-mixing MLPs over swapped axes)", mixer),
]
MODELS: dict[str, Model] = {m.name: m for m in _ENTRIES}
TRAIN = [m.name for m in _ENTRIES if not m.inference]
INFERENCE = [m.name for m in _ENTRIES if m.inference]
