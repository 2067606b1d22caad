"""DeepSpeed's ``Autotuner``: profile the model, prune the space by memory, search it with real
launches, and write the best configuration (``results_dir/ds_config_optimal.json``).

Driven by the launcher: ``shardspeed --autotuning tune|run [launcher flags] script.py
--deepspeed_config cfg.json ...``. ``tune`` stops after writing the results; ``run`` then
launches the job with the best configuration (and the ``arg_mappings`` script arguments).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from typing import Any

from shardspeed.autotuning.experiment import (
    ExperimentResult,
    launcher_argv,
    run_experiment,
)
from shardspeed.autotuning.fit import (
    GB,
    ModelInfo,
    default_memory_limit,
    fit_points,
    whole_model_info,
)
from shardspeed.autotuning.report import write_results
from shardspeed.autotuning.space import (
    AutotuningSpaceError,
    Point,
    apply_arg_mappings,
    build_space,
    config_path_in_args,
    experiment_config,
    replace_config_path,
)
from shardspeed.autotuning.tuner import make_tuner, search
from shardspeed.config.autotuning import DeepSpeedAutotuningConfig
from shardspeed.config.loader import load_config_dict
from shardspeed.utils.logging import logger

__all__ = ["Autotuner", "AutotuningError", "autotune"]

PROFILE_EXP = "profile_model_info"
OPTIMAL_CONFIG = "ds_config_optimal.json"


class AutotuningError(ValueError, AssertionError):
    """Tuning cannot go on (nothing fits, no experiment succeeded); the message says why and
    what to change. An AssertionError too, as DeepSpeed asserts in the same places."""


class Autotuner:
    """Finds the fastest configuration of the user's job that fits in memory."""

    def __init__(self, args: argparse.Namespace, active_resources: dict[str, list[int]]) -> None:
        self.args = args
        config_file = config_path_in_args(list(args.user_args))
        if config_file is None:
            raise AutotuningSpaceError(
                "--autotuning needs the script's config file: pass --deepspeed_config cfg.json "
                "(or --deepspeed cfg.json) after the script"
            )
        self.user_config = load_config_dict(config_file)
        self.autotuning_config = DeepSpeedAutotuningConfig.from_dict(
            self.user_config.get("autotuning")
        )
        at = self.autotuning_config
        self.world_size = sum(len(slots) for slots in active_resources.values())
        self.ranks_per_node = max((len(s) for s in active_resources.values()), default=1)
        self.exps_dir, self.results_dir = at.exps_dir, at.results_dir
        if at.overwrite:
            for folder in (self.exps_dir, self.results_dir):
                _check_removable(folder, config_file)
                shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(self.exps_dir, exist_ok=True)
        os.makedirs(self.results_dir, exist_ok=True)
        self.records: list[dict[str, Any]] = []
        self.optimal_point: Point | None = None
        self.optimal_ds_config: dict[str, Any] | None = None
        self.optimal_cmd: list[str] | None = None
        self.model_info: dict[str, Any] | None = None
        self.start_time = time.time()

    # -- DeepSpeed's queries ----------------------------------------------------------------------
    def metric(self) -> str:
        return self.autotuning_config.metric

    def fast_enabled(self) -> bool:
        return self.autotuning_config.fast

    def mixed_precision(self) -> bool:
        """Whether the job trains in fp16/bf16 (changes the bytes per parameter)."""
        return any(
            isinstance(self.user_config.get(k), dict) and bool(self.user_config[k].get("enabled"))
            for k in ("fp16", "bf16", "bfloat16")
        )

    def memory_limit(self) -> int:
        """Bytes per rank a configuration may need."""
        gb = self.autotuning_config.memory_limit_gb
        return int(gb * GB) if gb is not None else default_memory_limit(self.ranks_per_node)

    # -- launching --------------------------------------------------------------------------------
    def _autotuning_section(self, **overrides: Any) -> dict[str, Any]:
        section = dict(self.user_config.get("autotuning") or {})
        section.update(enabled=True, metric_path=None, model_info=None, model_info_path=None)
        section.update(overrides)
        return {k: v for k, v in section.items() if v is not None}

    def _launch(self, name: str, config: dict[str, Any]) -> ExperimentResult:
        exp_dir = os.path.abspath(os.path.join(self.exps_dir, name))
        user_args = replace_config_path(
            list(self.args.user_args), os.path.join(exp_dir, "ds_config.json")
        )
        user_args = apply_arg_mappings(user_args, self.autotuning_config.arg_mappings, config)
        return run_experiment(
            name,
            exp_dir,
            config,
            launcher_argv(self.args),
            self.args.user_script,
            user_args,
            self.autotuning_config.experiment_timeout_s,
        )

    def model_info_profile_run(self, points: list[Point]) -> dict[str, Any]:
        """The model's parameter counts and activation bytes per sample: given inline
        (``model_info`` with ``num_params``), cached (``model_info_path``), or measured by one
        short launch at the smallest micro-batch."""
        at = self.autotuning_config
        given = at.model_info or {}
        if "num_params" in given and not given.get("profile"):
            return dict(given)
        if at.model_info_path and os.path.isfile(at.model_info_path):
            with open(at.model_info_path) as fd:
                return dict(json.load(fd))
        # the fewest split ranks (stages) and checkpointing off if the space has them: the figures are
        # then the whole model's; a split or checkpointed probe's are scaled back
        small = min(
            points,
            key=lambda p: (
                p.tp_size * p.sp_size * p.pp_size,
                bool(p.ckpt),
                p.micro_batch,
                -min(p.stage, 2),
            ),
        )
        # ZeRO-3 gathers parameters into new storage, which would count as activations
        probe = dataclasses.replace(small, stage=min(small.stage, 2), offload="none", bucket=None)
        path = os.path.abspath(os.path.join(self.exps_dir, PROFILE_EXP, "model_info.json"))
        section = self._autotuning_section(model_info={"profile": True}, model_info_path=path)
        logger.info(f"autotuning: profiling the model ({probe.name})")
        result = self._launch(PROFILE_EXP, experiment_config(self.user_config, probe, section))
        if not os.path.isfile(path):
            raise AutotuningError(
                f"the model-info profiling run failed ({result.status}: {result.cause}); see "
                f"{os.path.join(self.exps_dir, PROFILE_EXP)}/stderr.log. Fix the script so it "
                "trains with this config, or give autotuning.model_info.num_params"
            )
        with open(path) as fd:
            info = whole_model_info(json.load(fd), probe)
        if at.model_info_path:
            os.makedirs(os.path.dirname(os.path.abspath(at.model_info_path)), exist_ok=True)
            with open(at.model_info_path, "w") as fd:
                json.dump(info, fd, indent=2)
        return info

    # -- the search -------------------------------------------------------------------------------
    def tune(self) -> Point:
        """Search the space; returns (and records) the best point."""
        at = self.autotuning_config
        space = build_space(self.user_config, at, self.world_size)
        self.model_info = self.model_info_profile_run(space.points)
        info = ModelInfo.from_dict(self.model_info)
        limit = self.memory_limit()
        fits = fit_points(space.points, info, space.dp_world, self.mixed_precision(), limit)
        estimates = {f.point: f.needed for f in fits}
        with open(os.path.join(self.results_dir, "space.json"), "w") as fd:
            rows = [{"name": f.point.name, "memory_bytes": f.needed, "fits": f.fits} for f in fits]
            json.dump({"memory_limit_bytes": limit, "points": rows}, fd, indent=2)
        fitting = [f.point for f in fits if f.fits]
        if not fitting:
            least = min(fits, key=lambda f: f.needed)
            raise AutotuningError(
                f"autotuning: no configuration fits in {limit / GB:.3f} GiB per rank (the "
                f"smallest, {least.point.name}, needs {least.needed / GB:.3f} GiB by the memory "
                "estimate); raise autotuning.memory_limit_gb, allow ZeRO-3 or offload "
                '(zero_optimization.stage "auto", autotuning.fast false), activation '
                'checkpointing (autotuning.activation_checkpointing "auto"), tensor '
                'parallelism (tensor_parallel.autotp_size "auto") or pipeline stages '
                '(autotuning.pipeline_stages "auto"), or lower '
                "min_train_micro_batch_size_per_gpu"
            )
        logger.info(
            f"autotuning: {len(fitting)} of {len(fits)} configurations fit in "
            f"{limit / GB:.3f} GiB per rank; tuner {at.tuner_type}, metric {at.metric}"
        )
        tuner = make_tuner(at.tuner_type, fitting, at.metric)

        def evaluate(point: Point) -> tuple[float | None, dict[str, Any]]:
            section = self._autotuning_section(
                metric_path=os.path.abspath(os.path.join(self.exps_dir, point.name, "metrics.json"))
            )
            result = self._launch(point.name, experiment_config(self.user_config, point, section))
            row = {
                "name": point.name,
                "memory_bytes": estimates[point],
                "status": result.status,
                "metrics": result.metrics,
                "cause": result.cause,
                "seconds": round(result.seconds, 2),
                "resumed": result.resumed,
            }
            self.records.append(row)
            value = result.value(at.metric)
            shown = f"{value:.4g} {at.metric}" if value is not None else result.cause
            logger.info(
                f"autotuning: trial {len(self.records)} {point.name}: {result.status}, {shown}"
            )
            return value, row

        trials = search(tuner, evaluate, at.tuner_num_trials, at.tuner_early_stopping)
        ok = [(p, r) for p, r in trials if r["status"] == "ok"]
        if not ok:
            raise AutotuningError(
                f"autotuning: none of the {len(trials)} experiments succeeded (see the causes in "
                f"{self.results_dir}/summary.txt and each {self.exps_dir}/<name>/stderr.log)"
            )
        pick = max if at.metric != "latency" else min
        self.optimal_point = pick(ok, key=lambda pr: pr[1]["metrics"][at.metric])[0]
        self.print_tuning_results()
        return self.optimal_point

    def print_tuning_results(self) -> None:
        """Print and write the results table (``summary.txt``) and plot."""
        best = self.optimal_point.name if self.optimal_point is not None else "none"
        footer = (
            f"Tuning completed in {time.time() - self.start_time:.1f} s, "
            f"{len(self.records)} experiment(s); optimal: {best}"
        )
        write_results(self.results_dir, self.records, self.metric(), footer)

    def get_best_config(self) -> dict[str, Any]:
        """The user's config with the best point's values (autotuning switched off)."""
        if self.optimal_point is None:
            raise AutotuningError("no tuning result yet; call tune() first")
        section = dict(self.user_config.get("autotuning") or {"enabled": False})
        section["enabled"] = False
        section.pop("metric_path", None)
        return experiment_config(self.user_config, self.optimal_point, section)

    def write_optimal_config(self) -> str:
        """Write ``ds_config_optimal.json`` and ``cmd_optimal.txt``; returns the config path."""
        self.optimal_ds_config = self.get_best_config()
        path = os.path.abspath(os.path.join(self.results_dir, OPTIMAL_CONFIG))
        with open(path, "w") as fd:
            json.dump(self.optimal_ds_config, fd, indent=2)
        user_args = replace_config_path(list(self.args.user_args), path)
        user_args = apply_arg_mappings(
            user_args, self.autotuning_config.arg_mappings, self.optimal_ds_config
        )
        self.optimal_cmd = [
            "shardspeed",
            *launcher_argv(self.args),
            self.args.user_script,
            *user_args,
        ]
        with open(os.path.join(self.results_dir, "cmd_optimal.txt"), "w") as fd:
            fd.write(" ".join(self.optimal_cmd) + "\n")
        logger.info(f"autotuning: optimal config written to {path}")
        return path

    def run_after_tuning(self) -> int:
        """Launch the user's job with the optimal config; returns its exit code."""
        from shardspeed.launcher import runner

        if self.optimal_cmd is None:
            self.write_optimal_config()
        assert self.optimal_cmd is not None
        args = runner.parse_args(self.optimal_cmd[1:])
        args.log_level, args.quiet = self.args.log_level, self.args.quiet
        logger.info(f"autotuning: launching {' '.join(self.optimal_cmd)}")
        return runner.run(args)


def _check_removable(folder: str, config_file: str) -> None:
    """``overwrite`` empties the results and experiment folders: refuse one that holds the
    working directory or the config file (e.g. ``exps_dir: "."``)."""
    target = os.path.realpath(folder)
    for inside in (os.getcwd(), os.path.dirname(os.path.realpath(config_file))):
        if os.path.commonpath([target, os.path.realpath(inside)]) == target:
            raise AutotuningError(
                f"autotuning.overwrite would delete {folder!r}, which holds {inside!r}; point "
                "exps_dir/results_dir at folders of their own (the defaults: autotuning_exps, "
                "autotuning_results)"
            )


def autotune(args: argparse.Namespace, active_resources: dict[str, list[int]]) -> int:
    """The launcher's ``--autotuning tune|run``; returns the exit code."""
    tuner = Autotuner(args, active_resources)
    tuner.tune()
    tuner.write_optimal_config()
    if args.autotuning == "run":
        return tuner.run_after_tuning()
    return 0
