"""The RL loop's config for tests: a tiny arithmetic model, real engine, DeepSpeed on gloo."""

from __future__ import annotations


def rl_config(tmp_path, model_dir, *, steps=4, mode="async", learners=1, zero=0, extra=""):
    path = tmp_path / f"rl-{mode}-{learners}.yaml"
    path.write_text(
        f"""
run: {{name: rl, metrics_every_s: 2, mode: {mode}}}
transport: {{inbox: 16}}
stages:
  feeder:
    use: feeder
    source: &source {{kind: arithmetic, tokenizer: "{model_dir}"}}
    epochs: 0
  generator:
    use: generator
    inputs: {{prompts: feeder.prompts}}
    launch: {{model: "{model_dir}", count: 1}}
    group_size: 4
    sampling: {{temperature: 1.0, max_new_tokens: 5}}
    max_lag: 2
    sync_batch: 16
  scorer:
    use: scorer
    inputs: {{rollouts: generator.rollouts}}
    rewards: [{{fn: exact_match}}]
    tokenizer: "{model_dir}"
    workers: 1
  learner:
    use: learner
    replicas: {learners}
    inbox: 4
    inputs: {{groups: scorer.groups}}
    model: "{model_dir}"
    steps: {steps}
    batch_size: 16
    train_micro_batch: 4
    forward_micro_batch: 8
    max_lag: 2
    # the random model earns no reward: with the default every sample would skip its passes,
    # and these tests check the loop's training (test_default_config runs the default)
    skip_no_signal: false
    optim: {{lr: 0.001}}
    deepspeed: {{zero_stage: {zero}}}
    checkpoint: {{every: 2, keep: 2}}
    eval: {{source: *source, rewards: [{{fn: exact_match}}], max_prompts: 20, max_new_tokens: 5}}
{extra}
"""
    )
    return path
