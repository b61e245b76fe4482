"""One `eval_tasks` entry, checked with the rest of the config (training/config_checks.py) before lm-eval is imported."""
import dataclasses

from omegaconf import OmegaConf

from errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EvalTask:
    """One eval_tasks entry: an lm-eval task, group or tag name, or a task YAML file, and how many of its documents
    to score (None: all)."""
    spec: str
    limit: int | None = None

    @classmethod
    def from_entry(cls, entry):
        if isinstance(entry, str) and entry:
            return cls(entry)
        fields = OmegaConf.to_container(entry) if OmegaConf.is_config(entry) else entry
        limit = fields.get("limit") if isinstance(fields, dict) else None
        if (not isinstance(fields, dict) or set(fields) - {"task", "limit"} or not isinstance(fields.get("task"), str)
                or not (limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit > 0))):
            raise ConfigError(f"eval_tasks entry {fields!r}: give a task name or task YAML file, or {{task: NAME, "
                              f"limit: N}} with N a positive number of documents (or null for all).")
        return cls(fields["task"], limit)
