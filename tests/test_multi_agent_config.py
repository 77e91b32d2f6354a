"""The multi-agent config surface: ``.multi_agent(...)``, ``PolicySpec``, ``RLModuleSpec`` /
``MultiRLModuleSpec``, the checks at ``build()`` and the plan resolved from a config and an env."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from actors.modules import ActorCriticModule, QModule, to_torch
from pipeline import (ConfigError, DQNConfig, MultiRLModuleSpec, PolicySpec, PPOConfig, RLModuleSpec,
                      multi_agent_plan)
from pipeline.config.multi_agent import mapping_function
from protocols.multi_agent_episode import MultiAgentEpisode

OBS4 = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
OBS3 = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
ACT2 = gym.spaces.Discrete(2)
ACT5 = gym.spaces.Discrete(5)


class TwoAgentEnv:
    """Duck-typed multi-agent env: agents 0 and 1, with per-agent spaces."""

    def __init__(self, obs=(OBS4, OBS4), act=(ACT2, ACT2), getters: bool = True) -> None:
        self.possible_agents = [0, 1]
        self.observation_spaces = dict(enumerate(obs))
        self.action_spaces = dict(enumerate(act))
        if getters:
            self.get_observation_space = self.observation_spaces.__getitem__
            self.get_action_space = self.action_spaces.__getitem__


def per_agent(agent_id, episode, **kwargs):
    return f"p{agent_id}"


def old_stack_mapping(agent_id, episode, worker, **kwargs):
    return "shared"


def only_p0(module_id, batch):
    return module_id == "p0"


class SmallModule(ActorCriticModule):
    pass


def problems(config) -> str:
    with pytest.raises(ConfigError) as err:
        config.validate()
    return str(err.value)


def ma(**kwargs):
    return PPOConfig().environment("CartPole-v1").multi_agent(**kwargs)


# --- the forms .multi_agent(...) takes ---------------------------------------------------------------------
def test_defaults_are_one_default_policy_for_everyone_all_trained_env_steps():
    cfg = PPOConfig().environment("CartPole-v1")
    assert not cfg.is_multi_agent and cfg.is_multi_agent() is False
    plan = multi_agent_plan(cfg, gym.make("CartPole-v1"))
    assert plan.module_ids == ["default_policy"] and plan.trainable == {"default_policy"}
    assert plan.count_steps_by == "env_steps" and plan.agent_modules == {} and not plan.is_multi_agent
    spec = plan.module_specs["default_policy"]
    assert spec.observation_space.shape == (4,) and spec.action_space.n == 2
    assert spec.module_class is ActorCriticModule
    assert plan.policy_mapping_fn("anyone", None) == "default_policy"


def test_policies_as_a_set_a_list_or_a_dict_of_specs_none_and_tuples():
    assert set(ma(policies={"p0", "p1"}).policies) == {"p0", "p1"}
    assert list(ma(policies=["a", "b"]).policies) == ["a", "b"]
    cfg = ma(policies={"a": None, "b": PolicySpec(observation_space=OBS3), "c": (None, OBS4, ACT5, {"lr": 1e-3})})
    assert cfg.policies["a"] == PolicySpec()
    assert cfg.policies["b"].observation_space == OBS3
    assert cfg.policies["c"] == PolicySpec(None, OBS4, ACT5, {"lr": 1e-3})
    assert all(isinstance(p, PolicySpec) for p in cfg.policies.values())
    assert cfg.is_multi_agent and cfg.is_multi_agent()


def test_a_lone_default_policy_is_not_multi_agent_but_another_single_id_is():
    assert not ma(policies={"default_policy"}).is_multi_agent
    assert ma(policies={"main"}).is_multi_agent


def test_rllibs_own_policy_spec_shape_is_accepted():
    class RayPolicySpec:  # the attributes of ray.rllib.policy.policy.PolicySpec
        def __init__(self):
            self.policy_class, self.observation_space, self.action_space, self.config = None, OBS3, ACT5, None

    cfg = ma(policies={"p0": RayPolicySpec()})
    assert cfg.policies["p0"] == PolicySpec(None, OBS3, ACT5, None)


def test_mapping_fn_in_rllibs_signatures_all_called_as_agent_and_episode():
    assert mapping_function(lambda agent_id, episode: "a")(0, None) == "a"
    assert mapping_function(lambda agent_id, episode, **kw: "b")(0, None) == "b"
    assert mapping_function(old_stack_mapping)(0, None) == "shared"  # worker gets None
    assert mapping_function("tests.test_multi_agent_config:per_agent")(1, None) == "p1"
    assert "cannot be called as fn(agent_id, episode)" in problems(ma(policy_mapping_fn=lambda agent_id: "x"))


def test_unknown_multi_agent_key_is_reported_with_the_valid_ones():
    text = problems(ma(policies={"p0"}, policy_mapping_fun=per_agent))
    assert "policy_mapping_fun" in text and "policy_mapping_fn" in text


# --- the checks at build() ----------------------------------------------------------------------------------
def test_policies_to_train_naming_an_unknown_module():
    text = problems(ma(policies={"p0", "p1"}, policy_mapping_fn=per_agent, policies_to_train=["p0", "p9"]))
    assert "policies_to_train names modules ['p9']" in text and "'p0'" in text and "'p1'" in text


def test_policies_to_train_as_one_string_or_a_number_is_refused():
    assert "policies_to_train must be module ids" in problems(ma(policies={"p0"}, policies_to_train="p0"))
    assert "policies_to_train must be module ids" in problems(ma(policies={"p0"}, policies_to_train=3))


def test_count_steps_by_must_be_one_of_two():
    text = problems(ma(count_steps_by="steps"))
    assert "count_steps_by='steps'" in text and "['env_steps', 'agent_steps']" in text


def test_mapping_fn_that_is_not_callable():
    text = problems(ma(policies={"p0"}, policy_mapping_fn=42))
    assert "policy_mapping_fn must be a function" in text and "42" in text


def test_empty_policies():
    assert "policies is empty" in problems(ma(policies=set()))
    assert "policies is empty" in problems(ma(policies={}))


def test_module_ids_multi_rl_module_would_refuse():
    text = problems(ma(policies={"team/a", "v1.2", "ok"}))
    assert "'team/a'" in text and "'v1.2'" in text and "'ok'" not in text.split("not allowed")[0]
    assert "team_a" in text and "v1_2" in text  # the fix
    assert "[0]" in problems(ma(policies={0: None}))  # not a str


def test_policies_of_the_wrong_type_and_bad_entries():
    assert "policies must be module ids" in problems(ma(policies="p0"))
    assert "policies['p0']=42 is not a PolicySpec" in problems(ma(policies={"p0": 42}))
    assert "not an RLModule subclass" in problems(ma(policies={"p0": PolicySpec(policy_class=dict)}))
    assert "config must be a dict" in problems(ma(policies={"p0": PolicySpec(config=5)}))
    text = problems(ma(policies={"p0": PolicySpec(config={"lr": 1e-3, "learning_rate": 1})}))
    assert "['learning_rate']" in text and "PPOConfig.overrides" in text
    text = problems(ma(policies={"p0": PolicySpec(config={"model_config": {"fcnet_hidden": [8]}})}))
    assert "policies['p0'].config: model_config" in text and "fcnet_hiddens" in text


def test_policies_and_rl_module_spec_must_name_the_same_modules():
    cfg = ma(policies={"p0", "p1"}).rl_module(rl_module_spec=MultiRLModuleSpec(
        rl_module_specs={"p0": RLModuleSpec(), "p2": RLModuleSpec()}))
    text = problems(cfg)
    assert "only in policies: ['p1']" in text and "only in rl_module_specs: ['p2']" in text


def test_rl_module_spec_checks():
    text = problems(ma().rl_module(rl_module_spec=MultiRLModuleSpec(rl_module_specs={
        "p0": RLModuleSpec(module_class=dict), "p1": RLModuleSpec(catalog_class=object, model_config={"x": 1}),
        "p.2": RLModuleSpec(load_state_path="/tmp/x", learner_only=True)})))
    assert "rl_module_spec.rl_module_specs['p0'].module_class must be an RLModule subclass" in text
    assert "rl_module_specs['p1'].catalog_class" in text and "rl_module_specs['p1']: model_config" in text
    assert "load_state_path is not supported" in text and "learner_only=True" in text
    assert "module ids ['p.2']" in text
    assert "rl_module_spec must be RLModuleSpec" in problems(ma().rl_module(rl_module_spec=42))
    assert "shared inside a MultiRLModule" in problems(ma().rl_module(rl_module_spec=MultiRLModuleSpec(
        rl_module_specs=RLModuleSpec(), observation_space=OBS4)))
    with pytest.raises(ValueError, match="needs rl_module_specs"):
        MultiRLModuleSpec()


def test_build_validates_first_then_resolves_the_modules_on_the_env():
    with pytest.raises(ConfigError, match="count_steps_by"):
        ma(policies={"p0"}, count_steps_by="x").env_runners(num_env_runners=0).build()
    with pytest.raises(ConfigError, match="single-agent"):  # training itself: tests/test_multi_agent_train.py
        ma(policies={"p0", "p1"}, policy_mapping_fn=per_agent).env_runners(num_env_runners=0).build()
    with pytest.raises(NotImplementedError, match="issue 27"):
        PPOConfig().environment("CartPole-v1").rl_module(rl_module_spec=RLModuleSpec()).build()



def test_what_multi_agent_runs_do_not_do_yet_is_refused_by_validate_naming_the_setting(tmp_path):
    from pipeline import BCConfig

    ma(policies={"p0", "p1"}, policy_mapping_fn=per_agent).offline_data(output=str(tmp_path)).validate()  # built
    ppo = (PPOConfig().environment("CartPole-v1").offline_data(input_=str(tmp_path))
           .multi_agent(policies={"a", "b"}, policy_mapping_fn=per_agent))
    msg = problems(ppo)  # an on-line algorithm trained from a multi-agent recording
    assert "offline_data(input_=...) with PPO is not built for multi-agent runs yet" in msg

    class Custom(PPOConfig):
        algo_name = "Custom"

    msg = problems(Custom().environment("CartPole-v1").multi_agent(policies={"a", "b"}, policy_mapping_fn=per_agent))
    assert "Custom with multi_agent(...)" in msg and "['APPO', 'BC', 'CQL', 'DQN', 'IMPALA', 'MARWIL', 'PPO', 'SAC']" in msg
    bc = BCConfig().environment("CartPole-v1").offline_data(input_=str(tmp_path)).multi_agent(policies={"p0"})
    assert "is not a multi-agent recording" in problems(bc)  # BC trains several modules from a multi-agent one
    DQNConfig().environment("CartPole-v1").multi_agent(policies={"p0"}).validate()  # built: no problem

# --- the plan -----------------------------------------------------------------------------------------------
def test_both_agents_to_one_shared_module():
    cfg = ma(policies={"shared"}, policy_mapping_fn=old_stack_mapping, count_steps_by="agent_steps")
    plan = multi_agent_plan(cfg, TwoAgentEnv())
    assert plan.module_ids == ["shared"] and plan.agent_modules == {0: "shared", 1: "shared"}
    assert plan.module_specs["shared"].observation_space == OBS4 and plan.count_steps_by == "agent_steps"
    assert plan.is_multi_agent and plan.is_trainable("shared")
    episode = MultiAgentEpisode(plan.policy_mapping_fn, module_ids=plan.module_ids)  # what runners will do
    assert episode.module_for(0) == episode.module_for(1) == "shared"


def test_one_module_per_agent_with_their_own_spaces_from_either_env_form():
    for env in (TwoAgentEnv(obs=(OBS4, OBS3), act=(ACT2, ACT5)),
                TwoAgentEnv(obs=(OBS4, OBS3), act=(ACT2, ACT5), getters=False)):
        plan = multi_agent_plan(ma(policies={"p0", "p1"}, policy_mapping_fn=per_agent), env)
        assert plan.agent_modules == {0: "p0", 1: "p1"}
        assert (plan.module_specs["p0"].observation_space, plan.module_specs["p0"].action_space) == (OBS4, ACT2)
        assert (plan.module_specs["p1"].observation_space, plan.module_specs["p1"].action_space) == (OBS3, ACT5)
        module = plan.module_specs["p1"].build()
        assert module.forward_train(to_torch(np.zeros((2, 3), np.float32)))["action_dist_inputs"].shape == (2, 5)


def test_a_module_with_its_own_model_config_class_and_frozen_opponent():
    spec = MultiRLModuleSpec(rl_module_specs={
        "p0": RLModuleSpec(module_class=SmallModule, model_config={"fcnet_hiddens": [8]}),
        "p1": RLModuleSpec(observation_space=OBS3)})
    cfg = ma(policy_mapping_fn=per_agent, policies_to_train=["p0"]).rl_module(
        model_config={"fcnet_hiddens": [32], "fcnet_activation": "relu"}, rl_module_spec=spec)
    cfg.validate()
    assert cfg.is_multi_agent  # the spec's ids are the modules
    plan = multi_agent_plan(cfg, TwoAgentEnv())
    p0, p1 = plan.module_specs["p0"], plan.module_specs["p1"]
    assert p0.module_class is SmallModule and p1.module_class is ActorCriticModule
    assert p0.model_config == {"fcnet_hiddens": [8], "fcnet_activation": "relu"}  # the module's keys win
    assert p1.model_config == {"fcnet_hiddens": [32], "fcnet_activation": "relu"}
    assert p1.observation_space == OBS3 and p1.action_space == ACT2  # the spec's space, the agent's other one
    assert plan.trainable == {"p0"} and plan.is_trainable("p0") and not plan.is_trainable("p1")
    with pytest.raises(KeyError, match="p7"):
        plan.is_trainable("p7")


def test_policy_spec_config_gives_model_config_and_overrides():
    cfg = ma(policies={"p0": PolicySpec(config=PPOConfig.overrides(lr=1e-4, model_config={"fcnet_hiddens": [4]})),
                       "p1": None}, policy_mapping_fn=per_agent)
    plan = multi_agent_plan(cfg, TwoAgentEnv())
    assert plan.module_specs["p0"].model_config["fcnet_hiddens"] == [4]
    assert plan.config_overrides == {"p0": {"lr": 1e-4}}


def test_policies_to_train_as_a_function_decides_per_batch():
    plan = multi_agent_plan(ma(policies={"p0", "p1"}, policy_mapping_fn=per_agent, policies_to_train=only_p0),
                            TwoAgentEnv())
    assert plan.trainable is None and plan.is_trainable("p0", {"some": "batch"}) and not plan.is_trainable("p1")


def test_one_rl_module_spec_for_every_module_and_dqn_module_kwargs():
    cfg = DQNConfig().environment("CartPole-v1").training(dueling=False).multi_agent(
        policies={"p0", "p1"}, policy_mapping_fn=per_agent).rl_module(
        rl_module_spec=RLModuleSpec(model_config={"fcnet_hiddens": [16]}))
    cfg.validate()
    plan = multi_agent_plan(cfg, TwoAgentEnv())
    for spec in plan.module_specs.values():
        assert spec.module_class is QModule and spec.model_config["fcnet_hiddens"] == [16]
        assert spec.module_kwargs == cfg.module_kwargs() and spec.module_kwargs["dueling"] is False


def test_agents_of_one_module_with_different_spaces_is_an_error_naming_both():
    with pytest.raises(ConfigError) as err:
        multi_agent_plan(ma(policies={"shared"}, policy_mapping_fn=old_stack_mapping), TwoAgentEnv(obs=(OBS4, OBS3)))
    text = str(err.value)
    assert "module 'shared'" in text and "agent 0" in text and "agent 1" in text
    assert "(4,)" in text and "(3,)" in text


def test_mapping_to_an_unknown_module_names_the_agent():
    with pytest.raises(ConfigError, match=r"agent 1 to 'p1', which is not a module; the modules are \['p0'\]"):
        multi_agent_plan(ma(policies={"p0"}, policy_mapping_fn=per_agent), TwoAgentEnv())


def test_mapping_fn_reading_the_episode_gets_a_throwaway_one():
    def by_episode(agent_id, episode, **kw):  # the self-play pattern
        return "main" if hash(episode.id_) % 2 == agent_id else "random"

    plan = multi_agent_plan(ma(policies={"main", "random"}, policy_mapping_fn=by_episode), TwoAgentEnv())
    assert sorted(plan.agent_modules.values()) == ["main", "random"]


def test_a_module_no_agent_was_mapped_to_at_setup():
    cfg = ma(policies={"main", "main_v1"}, policy_mapping_fn=lambda aid, ep, **kw: "main")
    plan = multi_agent_plan(cfg, TwoAgentEnv())  # the agents share their spaces: the idle module takes them
    assert plan.module_specs["main_v1"].observation_space == OBS4
    cfg = ma(policies={"p0", "p1", "idle"}, policy_mapping_fn=per_agent)
    with pytest.raises(ConfigError, match="no agent was mapped to module 'idle' at setup and the agents' spaces differ"):
        multi_agent_plan(cfg, TwoAgentEnv(act=(ACT2, ACT5)))
    cfg = ma(policies={"main": None, "main_v1": PolicySpec(observation_space=OBS3, action_space=ACT5)},
             policy_mapping_fn=lambda aid, ep, **kw: "main")
    assert multi_agent_plan(cfg, TwoAgentEnv(act=(ACT2, ACT2))).module_specs["main_v1"].action_space == ACT5


def test_multi_agent_config_on_a_single_agent_env_is_an_error():
    with pytest.raises(ConfigError, match="single-agent"):
        multi_agent_plan(ma(policies={"p0", "p1"}), gym.make("CartPole-v1"))


def test_single_agent_config_on_a_multi_agent_env_shares_default_policy():
    plan = multi_agent_plan(PPOConfig().environment("CartPole-v1"), TwoAgentEnv())
    assert plan.agent_modules == {0: "default_policy", 1: "default_policy"} and plan.is_multi_agent


def test_env_without_spaces_for_an_agent():
    env = TwoAgentEnv(getters=False)
    env.possible_agents = [0, 1, 2]
    with pytest.raises(ConfigError, match="no observation space for agent 2"):
        multi_agent_plan(PPOConfig().environment("CartPole-v1"), env)


# --- saved configs ------------------------------------------------------------------------------------------
def test_to_dict_from_dict_round_trip():
    spec = MultiRLModuleSpec(rl_module_specs={
        "p0": RLModuleSpec(module_class=SmallModule, observation_space=OBS3, model_config={"fcnet_hiddens": [8]}),
        "p1": RLModuleSpec()})
    cfg = ma(policies={"p0": PolicySpec(action_space=ACT5, config={"lr": 1e-4}), "p1": None},
             policy_mapping_fn=per_agent, policies_to_train={"p0"}, count_steps_by="agent_steps").rl_module(
        rl_module_spec=spec)
    d = cfg.to_dict()
    assert d["policy_mapping_fn"] == "tests.test_multi_agent_config:per_agent"
    back = PPOConfig.from_dict(d)
    assert back.to_dict() == d
    assert back.policies == cfg.policies and back.rl_module_spec.rl_module_specs["p0"].observation_space == OBS3
    back.validate()
    a, b = multi_agent_plan(cfg, TwoAgentEnv()), multi_agent_plan(back, TwoAgentEnv())
    assert a.module_specs == b.module_specs and a.trainable == b.trainable == {"p0"}
    assert b.policy_mapping_fn(1, None) == "p1" and b.count_steps_by == "agent_steps"


def test_a_lambda_mapping_fn_is_left_out_of_a_saved_config_with_a_warning(caplog):
    cfg = ma(policies={"p0"}, policy_mapping_fn=lambda aid, ep, **kw: "p0")
    assert cfg.to_dict()["policy_mapping_fn"] is None
    assert "policy_mapping_fn" in caplog.text


def test_rllibs_other_multi_agent_settings_go_through_the_table():
    cfg = ma(policies={"p0"}, policy_map_capacity=200, policy_states_are_swappable=True)
    cfg.validate()  # ignored: runnel has no policy cache
    assert "wrapper of the MultiAgentEnv" in problems(ma(observation_fn=per_agent))
    assert "PolicySpec(config=PPOConfig.overrides" in problems(
        PPOConfig().environment("CartPole-v1").rl_module(algorithm_config_overrides_per_module={"p0": {"lr": 1}}))
