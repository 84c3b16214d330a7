"""FP8 GEMMs for the dense linears (train.float8), through torchao's float8 training, as TorchTitan applies it.

Converted: every nn.Linear of a transformer layer (attention projections of KDA and Gated MLA, the dense FFN, the
MoE's latent projections and shared experts) whose two widths are multiples of 16 (what torchao's float8 matmul
takes). Kept in the parameter dtype: the router (not an nn.Linear), the routed experts (a grouped matmul), the
embeddings, the LM head, the vision tower, and any linear with a width that is not a multiple of 16 (listed by
name in the result, never silently). On CPU the FP8 matmul is emulated (emulate=True); on CUDA it runs on the
tensor cores. The weights stay plain parameters under their own names, so initialisation, ZeRO and checkpoints
see the same tensors.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
"""train.float8 values."""


def float8_candidate(fqn: str, module: nn.Module) -> bool:
    """A dense linear of a transformer layer (the router and the head are never candidates)."""
    return isinstance(module, nn.Linear) and fqn.startswith("layers.") and "router" not in fqn


def float8_fits(module: nn.Linear) -> bool:
    """torchao's float8 matmul needs both widths to be multiples of 16."""
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(part: nn.Module, recipe: str, emulate: bool) -> dict[str, list[str]]:
    """Swap the part's dense linears for torchao Float8Linear in place. Returns {"converted": names, "skipped":
    names of candidates whose widths torchao cannot take}."""
    if recipe not in FLOAT8_RECIPES[1:]:
        raise ValueError(f"unknown float8 recipe {recipe!r}; choose one of {list(FLOAT8_RECIPES[1:])}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    done: dict[str, list[str]] = {"converted": [], "skipped": []}

    def keep(module: nn.Module, fqn: str) -> bool:
        if not float8_candidate(fqn, module):
            return False
        done["converted" if float8_fits(module) else "skipped"].append(fqn)
        return float8_fits(module)

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(part, config=config, module_filter_fn=keep)
    if done["skipped"]:
        logging.getLogger(__name__).warning(
            "train.float8: %d linears kept in the parameter dtype (a width not a multiple of 16): %s",
            len(done["skipped"]),
            ", ".join(done["skipped"]),
        )
    return done
