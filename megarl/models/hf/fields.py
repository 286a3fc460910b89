"""Reading HF config.json fields: the refusal every config reader raises, and RoPE settings
wherever a config keeps them."""

from typing import Any, Dict


def unsupported(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"unsupported config field {field}={value!r}: megarl supports {allowed}")


def require(cfg: Dict[str, Any], field: str, allowed_values: tuple, default: Any = None) -> None:
    value = cfg.get(field, default)
    if value not in allowed_values:
        raise unsupported(field, value, " or ".join(repr(v) for v in allowed_values))


def rope_settings(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """RoPE fields wherever the config keeps them: transformers >= 5 nests them in
    rope_parameters, older configs and published checkpoints use rope_scaling and top-level keys."""
    merged = dict(cfg.get("rope_scaling") or {})
    merged.update(cfg.get("rope_parameters") or {})
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    merged.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return merged
