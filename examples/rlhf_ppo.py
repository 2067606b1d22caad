"""RLHF with PPO in the DeepSpeed-Chat shape: actor, critic, reward and reference models, all at
ZeRO stage 3, the actor generating through the hybrid engine.

    torchrun --nproc_per_node 2 examples/rlhf_ppo.py [--iterations 5] [--out rewards.json]
    shardspeed --num_gpus 2 examples/rlhf_ppo.py      # the same with shardspeed's launcher

Every model is tiny and built from a config (nothing is downloaded):

* actor: a 2-layer Llama, ZeRO-3 with Adam and ``hybrid_engine.enabled``: ``actor.generate``
  gathers its parameters once per call and decodes the rollouts;
* reference: the actor's initial weights, ZeRO-3 without an optimizer (only forwards: the
  per-token KL penalty keeps the actor near it);
* critic: a Llama body with a scalar value head, ZeRO-3 with Adam;
* reward: a toy reward model, ZeRO-3 without an optimizer: a one-column embedding that scores a
  response by how many times it says the target token (a stand-in for a trained reward model,
  so the rise of the reward is easy to read).

Each iteration: sample responses to this rank's prompts, score them, compute per-token rewards
(the score on the last token minus ``kl_coef`` times the log-ratio to the reference at every
token), advantages by GAE from the critic's values, then PPO epochs of the clipped policy loss
(actor) and the clipped value loss (critic). Rank 0 prints one line per iteration and, with
``--out``, writes the mean reward per iteration as JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed import comm

VOCAB = 32
TARGET = 7  # the token the toy reward counts
PROMPT, RESPONSE = 4, 8


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def build_actor() -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class Critic(nn.Module):
    """A Llama body and a linear value head: one value per position."""

    def __init__(self) -> None:
        from transformers import LlamaModel

        super().__init__()
        torch.manual_seed(1)
        self.body = LlamaModel(llama_config())
        self.value_head = nn.Linear(self.body.config.hidden_size, 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


class CountReward(nn.Module):
    """The toy reward model: a response's score is how often it says ``TARGET``."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Embedding(VOCAB, 1)
        with torch.no_grad():
            self.score.weight.zero_()
            self.score.weight[TARGET] = 1.0

    def forward(self, response: torch.Tensor) -> torch.Tensor:
        return self.score(response).squeeze(-1).sum(dim=-1)


def config(lr: float | None, batch: int, hybrid: bool = False) -> dict[str, Any]:
    """ZeRO-3 with Adam at ``lr`` (None: no optimizer), the hybrid engine if ``hybrid``."""
    result: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if lr is not None:
        result["optimizer"] = {"type": "Adam", "params": {"lr": lr}}
    if hybrid:
        result["hybrid_engine"] = {"enabled": True, "max_out_tokens": PROMPT + RESPONSE}
    return result


def token_logprobs(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the response tokens of ``seq`` under ``logits`` of all of it."""
    logp = F.log_softmax(logits[:, PROMPT - 1 : -1].float(), dim=-1)
    return logp.gather(-1, seq[:, PROMPT:, None]).squeeze(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimates over the response positions."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        following = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * following - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages


def mean_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(tensor)
    return float(tensor) / comm.get_world_size()


def train(args: argparse.Namespace) -> list[float]:
    actor, *_ = shardspeed.initialize(model=build_actor(), config=config(args.lr, args.batch, True))
    reference, *_ = shardspeed.initialize(model=build_actor(), config=config(None, args.batch))
    critic, *_ = shardspeed.initialize(model=Critic(), config=config(args.lr, args.batch))
    reward_model, *_ = shardspeed.initialize(model=CountReward(), config=config(None, args.batch))
    reference.eval()
    reward_model.eval()
    generator = torch.Generator().manual_seed(10 + comm.get_rank())
    torch.manual_seed(20 + comm.get_rank())  # sampling differs per rank
    history = []
    for iteration in range(args.iterations):
        prompts = torch.randint(1, VOCAB, (args.batch, PROMPT), generator=generator)
        # 1. rollouts: the hybrid engine gathers the actor once and samples
        seq = actor.generate(prompts, max_new_tokens=RESPONSE, do_sample=True, top_k=0)
        with torch.no_grad():
            score = reward_model(seq[:, PROMPT:])
            old_logp = token_logprobs(actor(input_ids=seq).logits, seq)
            ref_logp = token_logprobs(reference(input_ids=seq).logits, seq)
            old_values = critic(seq)[:, PROMPT - 1 : -1]
        rewards = -args.kl_coef * (old_logp - ref_logp)
        rewards[:, -1] += score
        advantages = gae(rewards, old_values, gamma=1.0, lam=0.95)
        returns = advantages + old_values
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        # 2. PPO epochs on this batch
        for _ in range(args.ppo_epochs):
            logp = token_logprobs(actor(input_ids=seq).logits, seq)
            ratio = torch.exp(logp - old_logp)
            clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
            actor_loss = -torch.min(ratio * advantages, clipped * advantages).mean()
            actor.backward(actor_loss)
            actor.step()
            values = critic(seq)[:, PROMPT - 1 : -1]
            near = old_values + torch.clamp(values - old_values, -args.clip, args.clip)
            critic_loss = 0.5 * torch.max((values - returns) ** 2, (near - returns) ** 2).mean()
            critic.backward(critic_loss)
            critic.step()
        mean_reward = mean_over_ranks(float(score.mean()))
        history.append(mean_reward)
        if comm.get_rank() == 0:
            print(f"iteration {iteration}: mean reward {mean_reward:.3f}", flush=True)
    for engine in (actor, reference, critic, reward_model):
        engine.destroy()
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description="PPO with a hybrid-engine actor at ZeRO-3")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="prompts per rank and iteration")
    parser.add_argument("--ppo-epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--kl-coef", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--out", default=None, help="write the mean reward per iteration here")
    parser.add_argument("--local_rank", type=int, default=-1)  # the shardspeed launcher's
    args = parser.parse_args()
    shardspeed.init_distributed()
    history = train(args)
    if comm.get_rank() == 0 and args.out:
        with open(args.out, "w") as handle:
            json.dump({"mean_reward": history}, handle)


if __name__ == "__main__":
    main()
