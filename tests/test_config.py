"Config: RAGEN's defaults, KEY=value and environment settings, the checks that name a bad setting, and `--help`."
import dataclasses

import pytest

from ragen_nb.cli import train_main
from ragen_nb.config import Config


README = dict(data_dir='data/sokoban', dim_x=6, dim_y=6, num_boxes=1, max_steps=5, search_depth=30, micro_batch_size=1,
              train_batch_size=128, ppo_batch_size=64, max_start_length=400, max_response_length=100, max_obs_length=120,
              max_turns=5, num_update_per_roll=1, gcp=True, n_gpus=1, rollout_tp_size=1, gamma=1.0, lam=1.0,
              actor_lr=1e-6, critic_lr=1e-5, clip_ratio_low=0.2, clip_ratio_high=0.2, value_clip=0.5, entropy_coef=0.001, kl_coef=0.001,
              temperature=1.0)


def test_defaults_are_ragens():
    c = Config()
    assert {k: getattr(c, k) for k in README} == README


def test_from_args_converts_and_accepts_both_spellings():
    c = Config.from_args(['DIM_X=7', 'dim_y=8', '--max-turns=3', 'GCP=false', 'gamma=0.99', 'LOG_MODE="[\'wandb\']"',
                          'BASE_MODEL=Qwen/Qwen2.5-0.5B-Instruct', 'TRAIN_BATCH_SIZE=8', 'PPO_BATCH_SIZE=4'])
    assert (c.dim_x, c.dim_y, c.max_turns, c.gcp, c.gamma, c.log_mode, c.base_model) == \
        (7, 8, 3, False, 0.99, 'wandb', 'Qwen/Qwen2.5-0.5B-Instruct')
    assert type(c.gamma) is float and type(c.dim_x) is int and c.gcp is False
    assert Config.from_args(['GCP=1']).gcp is True
    assert Config.from_args([]) == Config()


@pytest.mark.parametrize('args, name', [
    (['TRAIN_BACH_SIZE=8'], 'TRAIN_BACH_SIZE'),                      # unknown key
    (['MAX_TURNS=five'], 'MAX_TURNS'),                               # not an int
    (['ACTOR_LR=fast'], 'ACTOR_LR'),                                 # not a number
    (['GCP=maybe'], 'GCP'),                                          # not a bool
    (['DIM_X'], 'KEY=value'),                                        # no '='
    (['PPO_BATCH_SIZE=48'], 'ppo_batch_size'),                       # 48 does not divide 128
    (['PPO_BATCH_SIZE=4', 'MICRO_BATCH_SIZE=3'], 'micro_batch_size'),
    (['MICRO_BATCH_SIZE=0'], 'micro_batch_size'),
    (['N_GPUS=2', 'ROLLOUT_TP_SIZE=4'], 'rollout_tp_size'),
    (['N_GPUS=2', 'ROLLOUT_TP_SIZE=2', 'ROLLOUT_ENGINE=vllm'], 'ROLLOUT_TP_SIZE=1'),
    (['NUM_BOXES=0'], 'num_boxes'),                                  # checked by EnvSettings
    (['DIM_X=2'], 'dim_x'),
    (['GAMMA=1.5'], 'gamma'),
    (['CLIP_RATIO_LOW=0'], 'clip_ratio_low'),
    (['CLIP_RATIO_LOW=1'], 'clip_ratio_low'),                         # the ratio's floor would be 0
    (['CLIP_RATIO_HIGH=-0.1'], 'clip_ratio_high'),
    (['DUAL_CLIP=1'], 'dual_clip'),                                  # must be > 1 or 0 (off)
    (['GROUP_SIZE=3'], 'group_size'),                                # 3 does not divide 128
    (['GROUP_SIZE=0'], 'group_size'),
    (['ROLLOUT_FILTER_RATIO=0.5'], 'GROUP_SIZE >= 2'),               # no group to rank
    (['ROLLOUT_FILTER_RATIO=0'], 'rollout_filter_ratio'),
    (['ROLLOUT_FILTER_RATIO=1.5'], 'rollout_filter_ratio'),
    (['GROUP_SIZE=16', 'ROLLOUT_FILTER_RATIO=0.1'], 'keeps none'),   # floor(0.1 x 8 rooms) = 0
    (['GROUP_SIZE=16', 'ROLLOUT_FILTER_RATIO=0.25'], 'PPO_BATCH_SIZE=32'),   # 32 kept, minibatches of 64: names the fix
    (['ADV_ESTIMATOR=ppo'], 'adv_estimator'),
    (['ADV_ESTIMATOR=grpo'], 'GROUP_SIZE >= 2'),                     # GRPO compares rollouts of one room
    (['ADV_ESTIMATOR=maxrl'], 'GROUP_SIZE >= 2'),                    # so does MaxRL
    (['DISTANCE_SHAPING=-0.1'], 'distance_shaping'),
    (['DISTANCE_SHAPING=0.1', 'ADV_ESTIMATOR=maxrl_clean', 'GROUP_SIZE=4', 'KL_COEF=0'], 'never reads'),   # MaxRL scores success only
    (['DISTANCE_SHAPING=0.1', 'ADV_ESTIMATOR=gigpo', 'GROUP_SIZE=4', 'KL_COEF=0'], 'GIGPO_NORM=grpo'),     # so does GiGPO's default
    (['ADV_ESTIMATOR=brpo', 'PER_TURN_REWARDS=True'], 'PER_TURN_REWARDS=False'),
    (['ADV_ESTIMATOR=arpo', 'GROUP_SIZE=2'], 'KL_LOSS_COEF'),             # k1 penalties would rank tied groups by KL noise
    (['KL_LOSS_COEF=0.01'], 'KL_COEF=0'),                            # KL in the reward and in the loss at once
    (['KL_COEF=0', 'KL_LOSS_TYPE=mse'], 'kl_loss_type'),
    (['HIGH_LEVEL_GAMMA=2'], 'high_level_gamma'),
    (['VAL_ROOMS=-1'], 'val_rooms'),
    (['LOG_MODE=tensorboard'], 'log_mode'),
    (['RECOMPUTE_OLD_LOGPROBS=False'], 'ROLLOUT_ENGINE=hf or decode'),  # 'auto' may sample with vLLM, whose logprobs differ
    (['RECOMPUTE_OLD_LOGPROBS=False', 'ROLLOUT_ENGINE=vllm'], 'recompute_old_logprobs'),
    (['RECOMPUTE_OLD_LOGPROBS=maybe'], 'auto, true or false'),
    (['BF16=yes'], 'auto, true or false'),
    (['BF16=true', 'RECOMPUTE_OLD_LOGPROBS=false', 'ROLLOUT_ENGINE=decode'], 'RECOMPUTE_OLD_LOGPROBS=auto'),   # bf16 passes round apart
    (['PACKED=True'], 'GCP=False'),
    (['PACKED=True', 'GCP=False', 'SHARE_PREFIX=True'], 'SHARE_PREFIX=False'),
    (['PACKED=True', 'GCP=False', 'CRITIC=shared'], 'shared critic'),
    (['SHARE_PREFIX=True'], 'GCP=False'),                                  # checkpointed layers keep no keys and values
    (['SHARE_PREFIX=True', 'GCP=False', 'N_GPUS=2'], 'N_GPUS=1'),
])
def test_bad_settings_name_the_setting(args, name):
    with pytest.raises(ValueError, match=name): Config.from_args(args)


def test_from_env_reads_only_ragens_variables_and_args_win():
    from ragen_nb.config import RAGEN_ENV_VARS
    environ = {'DIM_X': '7', 'LOG_MODE': "['wandb']", 'GCP': 'False', 'TRAIN_BATCH_SIZE': '32', 'PPO_BATCH_SIZE': '16',
               'SEED': '5', 'GAMMA': '0.5', 'HOME': '/root'}
    c = Config.from_env(['PPO_BATCH_SIZE=8'], environ=environ)
    assert (c.dim_x, c.log_mode, c.gcp, c.train_batch_size, c.ppo_batch_size, c.seed, c.gamma) == \
        (7, 'wandb', False, 32, 8, 0, 1.0)
    assert len(RAGEN_ENV_VARS) == 20 and all(hasattr(c, k.lower()) for k in RAGEN_ENV_VARS)
    assert set(RAGEN_ENV_VARS) == {'DATA_DIR', 'DIM_X', 'DIM_Y', 'NUM_BOXES', 'MAX_STEPS', 'SEARCH_DEPTH', 'BASE_MODEL',
                                   'EXPERIMENT_NAME', 'MICRO_BATCH_SIZE', 'TRAIN_BATCH_SIZE', 'PPO_BATCH_SIZE', 'MAX_START_LENGTH',
                                   'MAX_RESPONSE_LENGTH', 'MAX_OBS_LENGTH', 'MAX_TURNS', 'NUM_UPDATE_PER_ROLL', 'LOG_MODE', 'GCP',
                                   'N_GPUS', 'ROLLOUT_TP_SIZE'}   # RAGEN's exported variables, as before the re-cut
    with pytest.raises(ValueError, match='MAX_TURNS'): Config.from_env(environ={'MAX_TURNS': 'x'})


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match='train_batch_size'): Config(train_batch_size='8')
    with pytest.raises(ValueError, match='ppo_batch_size'): Config(train_batch_size=10, ppo_batch_size=4)


def test_log_mode_takes_ragens_list_spelling():
    assert Config.from_args(["LOG_MODE=['console','wandb']"]).log_mode == 'console,wandb'
    assert Config.from_args(['LOG_MODE=wandb, console']).log_mode == 'wandb,console'
    with pytest.raises(ValueError, match='log_mode'): Config.from_args(['LOG_MODE=console,tensorboard'])


def test_help_lists_every_setting_with_default_and_env_var(capsys):
    from ragen_nb.config import RECIPES
    assert train_main(['--help']) == 0
    text = capsys.readouterr().out
    assert text == Config.help() + '\n'
    for f in dataclasses.fields(Config): assert f'{f.name.upper()}={f.default}' in text
    n = len(dataclasses.fields(Config))
    lines = text.splitlines()
    settings = lines[2:2 + n]                                                # then the recipes, after a blank line
    assert all(l.startswith('  ') and len(l.split(None, 1)) == 2 for l in settings)   # each has a doc
    assert [l.split('=', 1)[0].strip() for l in settings] == [f.name.upper() for f in dataclasses.fields(Config)]
    assert lines[2 + n] == '' and lines[3 + n].startswith('RECIPE=name')
    assert lines[4 + n:] == [f'  {name}: {" ".join(args)}' for name, args in RECIPES.items()]   # every recipe, in full
    assert 'TRAIN_BATCH_SIZE=128' in text and '[env TRAIN_BATCH_SIZE]' in text and '[env SEED]' not in text
    assert train_main(['TRAIN_BACH_SIZE=8']) == 2
