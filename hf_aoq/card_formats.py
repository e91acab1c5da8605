"""What the storage formats named in a model card mean: one paragraph per format family the
checkpoint uses (model_card.py puts them under the recipe table), beyond the short scheme names
of `checkpoint.describe`. A family is a prefix of those names and a function that writes its
text from the names present; MX (OCP Microscaling) so far."""
from __future__ import annotations

from typing import Callable, Iterable

_MX_ELEMENTS = {
    "e2m1": "MXFP4: 4-bit floats e2m1 (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6), two per byte; 4.25 bits per weight",
    "e4m3": "MXFP8: 8-bit floats e4m3 (up to ±448); 8.25 bits per weight",
    "e5m2": "MXFP8: 8-bit floats e5m2 (up to ±57344); 8.25 bits per weight",
}


def _kernel_rows(type_name: str) -> list[str]:
    """hf_aoq's own kernels for `type_name` (the kernel table's rows), as `name` (device)."""
    from . import kernels

    rows = [k for k in kernels.kernels_for("linear", type_name) if k.backend != "reference"]
    return [f"`{k.name}` ({k.device_type or 'any device'})" for k in rows]


def _mx(schemes: list[str]) -> str:
    elements = sorted({s.split()[1] for s in schemes if len(s.split()) > 1})
    acts = sorted({s.split("dyn-act mx ", 1)[1].split()[0] for s in schemes if "dyn-act mx " in s})
    lines = ["**MX weights** (OCP Microscaling v1.0): every block of 32 consecutive weights along a layer's "
             "input dimension shares one power-of-two scale, stored as an 8-bit exponent (e8m0, 2^(code - 127)); "
             "each weight is a small float:", ""]
    lines += [f"- `mx {e}`: {_MX_ELEMENTS.get(e, e)}." for e in elements]
    lines.append("")
    if acts:
        lines.append(f"`dyn-act mx {acts[0]}`{''.join(f' / `dyn-act mx {a}`' for a in acts[1:])}: that layer's "
                     f"activations are quantized the same way (blocks of 32 along the input, e8m0 scales) as the "
                     f"model runs. Layers without it keep their activations in the model's dtype (weight-only).")
    else:
        lines.append("Activations stay in the model's dtype (weight-only).")
    lines.append("")
    own = _kernel_rows("MXTensor")
    where = (f"hf_aoq's own MX kernels: {', '.join(own)}; " if own else "")
    lines.append(f"Where it runs: hf_aoq's kernel table picks a kernel per call. {where}any other case (device, "
                 f"format, batch size) dequantizes the weight exactly and runs the float matmul, on CPU and CUDA "
                 f"alike. The stored layout is the same on every device.")
    return "\n".join(lines)


FAMILIES: dict[str, Callable[[list[str]], str]] = {"mx ": _mx}


def format_notes(schemes: Iterable[str]) -> str:
    """The paragraphs for the format families among `schemes`, each after a blank line (the card
    template puts them right after the text above); empty when no family needs one."""
    schemes = list(schemes)
    parts = [write([s for s in schemes if s.startswith(prefix)]) for prefix, write in FAMILIES.items()
             if any(s.startswith(prefix) for s in schemes)]
    return "".join("\n\n" + p for p in parts)
