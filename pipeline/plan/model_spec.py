"""The model a config means: what every policy copy is rebuilt from, a user's own model included."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from pipeline.plan.validate import ConfigError, import_target

#: the model keys of a recurrent core (components.recurrent), given to a model only when model.rnn is set or it takes them
RECURRENT_KEYS = ("rnn", "rnn_hidden", "rnn_layers")


def model_spec_for(cfg: DictConfig) -> Any:
    """What every policy copy is rebuilt from (the server's, each inline worker's, the learner's, the probe's).

    A model of the user's own (``model._target_``) gets the ``model.*`` keys
    every model config has only where its constructor takes them, and every
    key it added (``+model.width=256``) as given (see
    :func:`components.model_contract.accepted_kwargs`).
    """
    import dataclasses

    from omegaconf import OmegaConf

    from components.model_contract import accepted_kwargs
    from components.models import ModelSpec
    from pipeline.plan.rules import NUMPY_MODELS, RECURRENT_MODEL
    from pipeline.plan.schema import ModelSchema

    kwargs = OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True)
    assert isinstance(kwargs, dict)
    target = str(kwargs.pop("_target_"))
    rnn = kwargs.get("rnn")
    if target in NUMPY_MODELS:
        if rnn is None:  # the built-in feed-forward networks take no recurrent keys
            kwargs = {k: v for k, v in kwargs.items() if k not in RECURRENT_KEYS}
        elif target == "components.models.QNetwork" or str(cfg.trainer.name) == "dqn":
            raise ConfigError(f"model.rnn={rnn}: a recurrent model is trained by trainer=ppo only "
                              "(trainer=dqn with a recurrent Q-network is not supported)")
        else:
            target = RECURRENT_MODEL
    if target not in NUMPY_MODELS and target != RECURRENT_MODEL:
        cls = import_target("model._target_", target)
        common = {f.name for f in dataclasses.fields(ModelSchema)} - {"_target_"}
        kwargs = accepted_kwargs(cls, kwargs, optional=common)
    return ModelSpec(target, kwargs)


def build_model(cfg: DictConfig, model_spec: Any, env_spec: Any) -> Any:
    """``model_spec`` built for ``env_spec`` and run once as the trainer and the server will (one line if it breaks).

    Done on the driver before any process starts (and before the layout
    probe times it): a model that breaks the contract of
    :mod:`components.model_contract` would otherwise fail in every worker
    and server, in torch's words.
    """
    from components.model_contract import ModelContractError, check_model
    from pipeline.plan.rules import NUMPY_MODELS, RECURRENT_MODEL, SAC_ACTOR

    if str(cfg.trainer.name) == "sac" and env_spec.action_kind != "continuous":
        kind = {"discrete": "Discrete", "multi_discrete": "MultiDiscrete",
                "multi_binary": "MultiBinary"}.get(env_spec.action_kind, env_spec.action_kind)
        raise ConfigError(f"trainer=sac: env.id={cfg.env.id!r} has {kind} actions; SAC needs continuous (Box) ones "
                          "(use trainer=dqn or trainer=ppo)")
    if str(cfg.trainer.name) == "dqn" and env_spec.action_kind != "discrete":
        kind = {"continuous": "continuous (Box)", "multi_discrete": "MultiDiscrete",
                "multi_binary": "MultiBinary"}.get(env_spec.action_kind, env_spec.action_kind)
        raise ConfigError(f"trainer.name='dqn': env.id={cfg.env.id!r} has {kind} actions; "
                          "DQN needs Discrete ones (use trainer=ppo)")
    try:
        model = model_spec.build(env_spec)
    except (ValueError, KeyError, TypeError) as err:
        text = str(err).strip("'\"")
        if model_spec.target not in (*NUMPY_MODELS, RECURRENT_MODEL, SAC_ACTOR):  # the user's class: its words, named
            raise ConfigError(f"model._target_={model_spec.target!r}: {type(err).__name__}: {text}") from None
        raise ConfigError(text if text.startswith("model.") else f"model.encoder={str(cfg.model.encoder)!r}: {text}") \
            from None
    try:
        check_model(model, env_spec, str(cfg.trainer.name))
    except ModelContractError as err:
        raise ConfigError(f"model._target_={model_spec.target!r}: {err}") from None
    return model
