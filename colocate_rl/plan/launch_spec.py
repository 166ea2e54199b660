"""`launch.json`: what the launcher tells every rank beyond the recipe, as one typed object that crosses the process
boundary (the plan writes it, `colocate_rl.rank.worker` reads it). Torch-free."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colocate_rl import rundir
from colocate_rl.errors import UserError
from colocate_rl.plan.engine_options import EngineOptions


@dataclass(frozen=True)
class LaunchSpec:
    model_path: str  # the run dir's built-in model link, or the recipe's model name/path
    algorithm: str  # an algorithm's name (colocate_rl.algorithms): it picks TRL's config and trainer class
    backend: str  # vllm or transformers
    device: str  # cuda or cpu
    world_size: int
    trl_args: dict[str, Any]  # TRL GRPOConfig/RLOOConfig arguments
    engine: EngineOptions | None  # colocate-rl's vLLM engine; None: TRL's engine or no vLLM
    recipe_hash: str  # the recipe identity the run dir's files were written for
    resume_from: str | None = None  # `train --resume`: the checkpoint the launcher checked whole; every rank takes it
    # What the ranks would otherwise derive from the recipe; a launch.json of an earlier version lacks them (`read`)
    builtin_model: bool = False  # model_path is the run dir's built-in model (its tokenizer loads the way it was saved)
    model_dtype: str = "float32"  # the weights' dtype: training (TRL's model_init_kwargs) and final/
    held_out_rows: int | None = None  # rows at the end of a data file left to evaluation; None: not recorded
    engine_process: bool = False  # the generation engine runs in a process of its own (generation.engine_process)
    overlap: bool = False  # the next step's prompts generate while this step trains (generation.overlap: one_step)

    def to_json(self) -> str:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["engine"] = self.engine.to_json() if self.engine is not None else None
        if self.resume_from is None:
            del data["resume_from"]  # a fresh run's launch.json is what earlier versions wrote
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> LaunchSpec:
        """Read a run directory's launch.json. Fails (UserError) when it is missing or not one this version wrote."""
        try:
            data = json.loads(Path(path).read_text())
            engine = data.pop("engine")
            if "model_dtype" not in data:  # an earlier version's: what it recorded elsewhere
                run_dir = Path(data["trl_args"]["output_dir"]).parent
                data["builtin_model"] = data["model_path"] == str(run_dir / rundir.MODEL_LINK)
                data["model_dtype"] = data["trl_args"]["model_init_kwargs"]["dtype"]
            return cls(**data, engine=EngineOptions.from_json(engine) if engine is not None else None)
        except OSError as e:
            raise UserError(
                f"{path}: cannot read the launch spec ({e.strerror or e}); start the run with `colocate-rl train`"
            )
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise UserError(
                f"{path}: not a launch spec of this colocate-rl version ({e}); start a new run with `colocate-rl train`"
            )
