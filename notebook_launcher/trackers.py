"""Accelerate's experiment trackers (``accelerate.tracking``): ``Accelerator(log_with=...)``.

TensorBoard (torch's ``SummaryWriter``), W&B, MLflow, Comet, Aim, ClearML, DVCLive, SwanLab
and Trackio, each through its own package, and your own :class:`GeneralTracker` subclasses.
As in Accelerate they start in ``accelerator.init_trackers(project, config)``, receive
``accelerator.log`` on the main process only (unless a tracker sets
``main_process_only = False``) and finish in ``accelerator.end_training()``. Asking for a
tracker whose package is not installed raises ``ImportError`` at ``Accelerator(...)``
(Accelerate skips it silently, losing the logs). ``notebook_launcher.tracking`` re-exports
these names (Accelerate's module path) next to the dashboard's light ``log()``.

Example::

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
    accelerator.init_trackers("my_run", config={"lr": 1e-3})
    accelerator.log({"loss": 0.25}, step=10)     # TensorBoard, and the dashboard's plot
    accelerator.end_training()
"""

from __future__ import annotations

import functools
import json
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

from .state import PartialState, parse_flag_from_env
from .utils.dataclasses import LoggerType
from .utils.imports import (
    is_aim_available,
    is_clearml_available,
    is_comet_ml_available,
    is_dvclive_available,
    is_mlflow_available,
    is_swanlab_available,
    is_tensorboard_available,
    is_trackio_available,
    is_wandb_available,
)

# Accelerate's logger name, so that logging set up for Accelerate applies (README).
logger = logging.getLogger("accelerate.tracking")


# --------------------------------------------------------------------------- trackers


def on_main_process(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for tracker methods: run on the main process only when the tracker's
    ``main_process_only`` is True (decided at call time, so a tracker can be created before
    the process group exists)."""

    @functools.wraps(function)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not PartialState().is_main_process:
            return None
        return function(self, *args, **kwargs)

    return method


class GeneralTracker:
    """Base class of the experiment trackers; subclass it for your own.

    A subclass defines ``name`` (how ``log_with`` and ``get_tracker`` call it),
    ``requires_logging_directory`` (whether its constructor takes the project's logging
    directory after the run name) and a ``tracker`` property (the underlying run object), and
    overrides what it needs of ``start`` (called by ``init_trackers``),
    ``store_init_configuration``, ``log`` and ``finish`` (called by ``end_training``). With
    ``main_process_only = False`` every rank calls them.

    Example::

        class PrintTracker(GeneralTracker):
            name = "print"
            requires_logging_directory = False

            @property
            def tracker(self):
                return None

            def log(self, values, step=None, **kwargs):
                print(step, values)

        accelerator = Accelerator(log_with=PrintTracker())
    """

    main_process_only = True
    # Declared for type checkers; a subclass sets them (checked at construction).
    name: str
    requires_logging_directory: bool

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        missing = [
            f"`{attr}`"
            for attr in ("name", "requires_logging_directory", "tracker")
            if attr not in dir(self)
        ]
        if missing:
            raise NotImplementedError(
                "The implementation for this tracker class is missing the following required "
                f"attributes. Please define them in the class definition: {', '.join(missing)}"
            )

    def start(self) -> None:
        """Start the run (called by ``init_trackers``, after the process group exists)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` as the run's hyperparameters."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (name -> value) at ``step``."""

    def finish(self) -> None:
        """End the run (called by ``end_training``)."""


def _scalar(value: Any) -> Any:
    """A one-element tensor or numpy scalar as a Python number; anything else unchanged."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None)
    size = getattr(value, "size", None)
    single = (callable(numel) and numel() == 1) or (isinstance(size, int) and size == 1)
    if callable(item) and single:
        return item()
    return value


def _require(package: str, available: bool, tracker: str) -> None:
    if not available:
        raise ImportError(
            f"log_with={tracker!r} needs the `{package}` package, which is not installed: "
            f"`pip install {package}` (or remove {tracker!r} from log_with)."
        )


class TensorBoardTracker(GeneralTracker):
    """TensorBoard, through ``torch.utils.tensorboard.SummaryWriter`` (or tensorboardX).

    Event files go to ``{logging_dir}/{run_name}``; ``store_init_configuration`` also writes
    ``hparams.yml`` there. Numbers become scalars, strings text, dicts of numbers grouped
    scalars; one-element tensors are numbers. ``kwargs`` go to ``SummaryWriter``.
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__()
        _require("tensorboard", is_tensorboard_available(), self.name)
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.init_kwargs = kwargs
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # only tensorboardX installed
            from tensorboardX import SummaryWriter  # type: ignore[no-redef]
        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()
        os.makedirs(self.logging_dir, exist_ok=True)
        with open(os.path.join(self.logging_dir, "hparams.yml"), "w") as out:
            json.dump(values, out, default=str, indent=2)  # JSON is YAML

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            value = _scalar(value)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                scalars = {k: _scalar(v) for k, v in value.items()}
                self.writer.add_scalars(key, scalars, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``values``: name -> images (an array ``N x H x W x C`` or a list of them)."""
        for key, value in values.items():
            self.writer.add_images(key, value, global_step=step, **kwargs)
        self.writer.flush()

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


class WandBTracker(GeneralTracker):
    """Weights & Biases: ``wandb.init(project=run_name, **kwargs)`` (``WANDB_MODE=offline``
    writes the run locally, under ``WANDB_DIR``)."""

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        _require("wandb", is_wandb_available(), self.name)
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    @on_main_process
    def start(self) -> None:
        import wandb

        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log({k: _scalar(v) for k, v in values.items()}, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        import wandb

        images = {k: [wandb.Image(image) for image in v] for k, v in values.items()}
        self.log(images, step=step, **kwargs)

    @on_main_process
    def log_table(
        self,
        table_name: str,
        columns: list[str] | None = None,
        data: list[list[Any]] | None = None,
        dataframe: Any = None,
        step: int | None = None,
        **kwargs: Any,
    ) -> None:
        import wandb

        table = wandb.Table(columns=columns, data=data, dataframe=dataframe)  # type: ignore[arg-type]
        self.log({table_name: table}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class TrackioTracker(GeneralTracker):
    """Trackio: ``trackio.init(project=run_name, **kwargs)``."""

    name = "trackio"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        _require("trackio", is_trackio_available(), self.name)
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    @on_main_process
    def start(self) -> None:
        import trackio

        self.run = trackio.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import trackio

        trackio.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log({k: _scalar(v) for k, v in values.items()}, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


class CometMLTracker(GeneralTracker):
    """Comet: ``comet_ml.start(project_name=run_name, **kwargs)`` (``online=False`` with an
    ``ExperimentConfig(offline_directory=...)`` writes an offline archive)."""

    name = "comet_ml"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        _require("comet_ml", is_comet_ml_available(), self.name)
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        import comet_ml

        self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer.log_parameters(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            self.writer.set_step(step)
        for key, value in values.items():
            value = _scalar(value)
            if isinstance(value, (int, float)):
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.end()


class AimTracker(GeneralTracker):
    """Aim: a ``aim.Run(repo=logging_dir)`` named ``run_name``."""

    name = "aim"
    requires_logging_directory = True

    def __init__(
        self, run_name: str, logging_dir: str | os.PathLike[str] | None = ".", **kwargs: Any
    ) -> None:
        super().__init__()
        _require("aim", is_aim_available(), self.name)
        self.run_name = run_name
        self.aim_repo_path = os.fspath(logging_dir) if logging_dir is not None else "."
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        from aim import Run

        self.writer = Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.writer["hparams"] = values

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            self.writer.track(_scalar(value), name=key, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.writer.close()


class MLflowTracker(GeneralTracker):
    """MLflow: a run in experiment ``experiment_name`` (created with its artifacts under
    ``logging_dir`` if new). Each argument may also come from its ``MLFLOW_*`` variable
    (``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_TAGS`` as JSON, ``MLFLOW_NESTED_RUN``,
    ``MLFLOW_RUN_ID``, ``MLFLOW_RUN_NAME``); the tracking URI is MLflow's own setting
    (``mlflow.set_tracking_uri`` / ``MLFLOW_TRACKING_URI``, e.g. a ``file://`` store).
    Only numbers are logged as metrics; parameters longer than MLflow allows are left out.
    """

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool | None = False,
        run_name: str | None = None,
        description: str | None = None,
    ) -> None:
        super().__init__()
        _require("mlflow", is_mlflow_available(), self.name)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        tags = os.environ.get("MLFLOW_TAGS", tags)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = parse_flag_from_env("MLFLOW_NESTED_RUN", bool(nested_run))
        self.run_name = os.environ.get("MLFLOW_RUN_NAME", run_name)
        self.description = description
        self.logging_dir = os.fspath(logging_dir) if logging_dir is not None else None
        self.active_run: Any = None

    @on_main_process
    def start(self) -> None:
        import mlflow

        experiment_id = None
        if self.experiment_name:
            found = mlflow.get_experiment_by_name(self.experiment_name)
            if found is not None:
                experiment_id = found.experiment_id
            else:
                experiment_id = mlflow.create_experiment(
                    name=self.experiment_name, artifact_location=self.logging_dir, tags=self.tags
                )
        self.active_run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=experiment_id,
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            description=self.description,
        )

    @property
    def tracker(self) -> Any:
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {}
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                logger.warning(
                    "MLflow takes parameter values of at most %d characters: %r is left out.",
                    MAX_PARAM_VAL_LENGTH,
                    key,
                )
                continue
            params[key] = value
        items = list(params.items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start : start + MAX_PARAMS_TAGS_PER_BATCH]))

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        import mlflow

        metrics = {}
        for key, value in values.items():
            value = _scalar(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[key] = value
            else:
                logger.debug("MLflow logs numbers only: %r=%r is left out.", key, value)
        mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        import mlflow

        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class ClearMLTracker(GeneralTracker):
    """ClearML: ``Task.init(project_name=run_name, **kwargs)`` (or the current task)."""

    name = "clearml"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        _require("clearml", is_clearml_available(), self.name)
        self.user_provided_run_name = run_name
        self._initialized_externally = False
        self.init_kwargs = kwargs
        self.task: Any = None

    @on_main_process
    def start(self) -> None:
        from clearml import Task

        current = Task.current_task()
        if current is not None:
            self._initialized_externally = True
            self.task = current
            return
        kwargs = dict(self.init_kwargs)
        kwargs.setdefault(
            "project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name)
        )
        kwargs.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = Task.init(**kwargs)

    @property
    def tracker(self) -> Any:
        return self.task

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.task.connect_configuration(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        reporter = self.task.get_logger()
        for key, value in values.items():
            value = _scalar(value)
            if not isinstance(value, (int, float)):
                logger.debug("ClearML logs numbers only: %r=%r is left out.", key, value)
                continue
            if step is None:
                reporter.report_single_value(name=key, value=value, **kwargs)
                continue
            title, _, series = key.partition("/")
            if key.startswith(("eval", "test", "train")) and "_" in key and not series:
                title, _, series = key.partition("_")
            reporter.report_scalar(
                title=title, series=series or title, value=value, iteration=step, **kwargs
            )

    @on_main_process
    def finish(self) -> None:
        if self.task is not None and not self._initialized_externally:
            self.task.close()


class DVCLiveTracker(GeneralTracker):
    """DVCLive: a ``dvclive.Live(**kwargs)`` (or the ``live`` you pass); ``run_name`` is
    unused, as in Accelerate."""

    name = "dvclive"
    requires_logging_directory = False

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any) -> None:
        super().__init__()
        _require("dvclive", is_dvclive_available(), self.name)
        self.live = live
        self.init_kwargs = kwargs

    @on_main_process
    def start(self) -> None:
        from dvclive import Live

        self.live = self.live if self.live is not None else Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.live

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.live.log_params(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, value in values.items():
            value = _scalar(value)
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                logger.debug("DVCLive cannot log %r=%r: left out.", key, value)
        self.live.next_step()

    @on_main_process
    def finish(self) -> None:
        self.live.end()


class SwanLabTracker(GeneralTracker):
    """SwanLab: ``swanlab.init(project=run_name, **kwargs)``."""

    name = "swanlab"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        super().__init__()
        _require("swanlab", is_swanlab_available(), self.name)
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    @on_main_process
    def start(self) -> None:
        import swanlab

        self.run = swanlab.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import swanlab

        swanlab.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log({k: _scalar(v) for k, v in values.items()}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        self.run.finish()


#: Tracker name -> class, for ``log_with="name"`` (extend it with :func:`register_tracker_class`).
LOGGER_TYPE_TO_CLASS: dict[str, type[GeneralTracker]] = {
    "aim": AimTracker,
    "comet_ml": CometMLTracker,
    "mlflow": MLflowTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "clearml": ClearMLTracker,
    "dvclive": DVCLiveTracker,
    "swanlab": SwanLabTracker,
    "trackio": TrackioTracker,
}

_AVAILABLE: dict[str, Callable[[], bool]] = {
    "tensorboard": is_tensorboard_available,
    "wandb": is_wandb_available,
    "comet_ml": is_comet_ml_available,
    "aim": is_aim_available,
    "mlflow": is_mlflow_available,
    "clearml": is_clearml_available,
    "dvclive": is_dvclive_available,
    "swanlab": is_swanlab_available,
    "trackio": is_trackio_available,
}


def get_available_trackers() -> list[LoggerType]:
    """The built-in trackers whose package is installed."""
    return [LoggerType(name) for name, available in _AVAILABLE.items() if available()]


def register_tracker_class(tracker_class: type[GeneralTracker]) -> type[GeneralTracker]:
    """Make ``tracker_class`` usable as ``log_with=tracker_class.name``; its constructor is
    called by ``init_trackers`` as ``cls(project_name[, logging_dir], **init_kwargs)``.
    Re-registering a name warns and replaces the earlier class. Usable as a decorator."""
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"{tracker_class!r} is not a subclass of GeneralTracker")
    name = getattr(tracker_class, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{tracker_class.__name__} needs a `name` (a non-empty string)")
    if not isinstance(getattr(tracker_class, "requires_logging_directory", None), bool):
        raise ValueError(
            f"{tracker_class.__name__} needs `requires_logging_directory` (True or False)"
        )
    previous = LOGGER_TYPE_TO_CLASS.get(name)
    if previous is not None and previous is not tracker_class:
        warnings.warn(
            f"Tracker name {name!r} was registered for {previous.__name__}; "
            f"{tracker_class.__name__} replaces it.",
            UserWarning,
            stacklevel=2,
        )
    LOGGER_TYPE_TO_CLASS[name] = tracker_class
    return tracker_class


def filter_trackers(log_with: Any, logging_dir: str | os.PathLike[str] | None = None) -> list[Any]:
    """``log_with`` as a list of tracker names and :class:`GeneralTracker` instances.

    ``"all"`` means every installed built-in tracker. Raises ``ValueError`` for an unknown
    name or a tracker that needs a logging directory when there is none, and ``ImportError``
    for a built-in tracker whose package is not installed.
    """
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    found: list[Any] = []
    if any(str(item) == "all" for item in items if not isinstance(item, GeneralTracker)):
        found = [item for item in items if isinstance(item, GeneralTracker)]
        return found + [
            t
            for t in get_available_trackers()
            if not LOGGER_TYPE_TO_CLASS[str(t)].requires_logging_directory or logging_dir
        ]
    for item in items:
        if isinstance(item, GeneralTracker):
            found.append(item)
            continue
        name = str(item.value if isinstance(item, LoggerType) else item)
        cls = LOGGER_TYPE_TO_CLASS.get(name)
        if cls is None:
            raise ValueError(
                f"Unsupported logging capability: {item}. Choose between "
                f"{sorted(set(LoggerType.list()) | set(LOGGER_TYPE_TO_CLASS))}"
            )
        if name in _AVAILABLE:
            _require(name, _AVAILABLE[name](), name)
        if cls.requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"Logging with `{name}` requires a `logging_dir` to be passed in: "
                "Accelerator(project_dir=...) or project_config=ProjectConfiguration(logging_dir=...)"
            )
        if name not in found:
            found.append(name)
    return found


__all__ = [
    "LOGGER_TYPE_TO_CLASS",
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
]
