"""What the export's ``generation_config.json`` asks of every request, as transformers'
``model.generate`` reads it.

``generate`` starts from the model's generation config and lets its own arguments override
each setting. The settings that change which tokens come out whatever the request's sampling
are honoured or refused here, at load:

- ``repetition_penalty`` is the default of every request that does not set its own (a request's
  ``repetition_penalty``, 1.0 included, wins, as ``generate(repetition_penalty=...)`` does, and
  as vLLM's ``--generation-config auto`` applies it);
- the logits processors ortbatch does not have (``no_repeat_ngram_size``, ``bad_words_ids``,
  ``suppress_tokens``, forced tokens, beam search, ...) make the generator refuse to load with
  a :class:`~ortbatch.errors.ModelContractError` naming the setting: it would otherwise
  generate other tokens than ``generate`` does, silently.

The sampling settings (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``) are not
applied: a request's own fields, or their documented defaults, decide how it samples.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelContractError

__all__ = ["UNSUPPORTED", "ModelDefaults", "model_defaults", "read_generation_config_json", "read_model_defaults"]

#: generation_config.json settings that change ``generate``'s tokens and that ortbatch cannot
#: honour, each with the values that ask for nothing (transformers' defaults).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None, []),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "forced_decoder_ids": (None, []),
    "sequence_bias": (None, {}, []),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "exponential_decay_length_penalty": (None,),
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "guidance_scale": (None, 1, 1.0),
    "stop_strings": (None, []),
    "watermarking_config": (None,),
    "token_healing": (None, False),
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # type-strict, so that True does not pass for 1 nor 0 for False
    return any(type(value) is type(n) and value == n for n in neutral if n is not None) or value is None


@dataclass(frozen=True)
class ModelDefaults:
    """The request defaults an export's generation config sets (``repetition_penalty``: 1.0
    when it sets none)."""

    repetition_penalty: float = 1.0


def model_defaults(config: Mapping[str, Any], where: str = "generation_config.json") -> ModelDefaults:
    """The defaults ``config`` (a ``generation_config.json``'s contents) sets; a
    :class:`ModelContractError` naming the first setting ortbatch cannot honour."""
    for name, neutral in UNSUPPORTED.items():
        if name in config and not _neutral(config[name], neutral):
            raise ModelContractError(
                f"{where}: {name}={json.dumps(config[name])[:60]} is not supported: transformers' generate applies "
                "it to every request and ortbatch has no such logits processor, so the tokens would differ; "
                f"remove {name} from {Path(where).name} to serve the model without it"
            )
    penalty = config.get("repetition_penalty")
    if penalty is None:
        return ModelDefaults()
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty) or penalty <= 0:
        raise ModelContractError(f"{where}: repetition_penalty must be a number > 0, got {json.dumps(penalty)[:60]}")
    return ModelDefaults(repetition_penalty=float(penalty))


def read_generation_config_json(directory: Path) -> Mapping[str, Any] | None:
    """``directory/generation_config.json`` as a mapping (None: there is none); a file that is
    not a JSON object is a :class:`ModelContractError` naming it."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelContractError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(config, Mapping):
        raise ModelContractError(f"{path}: not a JSON object")
    return config


def read_model_defaults(directory: Path) -> ModelDefaults:
    """:func:`model_defaults` of ``directory/generation_config.json`` (none: no defaults)."""
    config = read_generation_config_json(directory)
    if config is None:
        return ModelDefaults()
    return model_defaults(config, str(directory / "generation_config.json"))
