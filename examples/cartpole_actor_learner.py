"""Actor/learner on gymnasium's CartPole-v1: actors play, one learner trains (PPO).

Each actor runs the environment with the newest policy it has, cuts its experience into
rollouts of ``--rollout`` steps, computes advantages (GAE) with its own value estimates,
stamps the rollout with the weight version that produced it and pushes it to the learner's
bounded queue; after every rollout it pulls the newest weights. The learner takes
``--batch-rollouts`` rollouts per update (dropping any more than ``--max-lag`` versions
old), runs PPO's clipped objective against the behaviour policy's log-probabilities the
actors sent, and publishes the new weights. Training stops when the greedy policy averages at
least ``--target`` over ``--eval-episodes`` episodes (checked whenever the recent training
episodes look good enough), or at ``--max-steps`` environment steps.

Under the launcher (worker 0 is the learner, the other workers are actors)::

    tensorfleet launch --ps 0 --workers 3 -- python examples/cartpole_actor_learner.py

Or on its own (it starts ``--actors`` actor processes itself)::

    python examples/cartpole_actor_learner.py --actors 2
    python examples/cartpole_actor_learner.py --single     # one process doing both (baseline)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from tensorfleet.patterns.actor_learner import ActorClient, SampleQueueServer, TensorSpec
from tensorfleet.patterns.broadcast import WeightPublisher, free_address

OBS, ACTIONS = 4, 2
SPEC = {
    "obs": TensorSpec(torch.float32, (OBS,)),
    "action": TensorSpec(torch.int64),
    "logp": TensorSpec(torch.float32),
    "advantage": TensorSpec(torch.float32),
    "ret": TensorSpec(torch.float32),
    # The return of the episode that ended at this step, else 0 (for monitoring).
    "episode_return": TensorSpec(torch.float32),
}


@dataclass
class Settings:
    rollout: int = 128
    batch_rollouts: int = 2
    epochs: int = 20
    lr: float = 1e-3
    gamma: float = 0.98
    lam: float = 0.8
    clip: float = 0.2
    max_lag: int = 1
    max_steps: int = 150_000
    target: float = 475.0
    eval_episodes: int = 100
    seed: int = 0


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi = nn.Sequential(
            nn.Linear(OBS, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, ACTIONS)
        )
        self.v = nn.Sequential(
            nn.Linear(OBS, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
        )

    def forward(self, obs: torch.Tensor) -> tuple[torch.distributions.Categorical, torch.Tensor]:
        return torch.distributions.Categorical(logits=self.pi(obs)), self.v(obs).squeeze(-1)


class Roller:
    """Plays one environment with a policy and cuts rollouts with GAE advantages."""

    def __init__(self, seed: int, settings: Settings) -> None:
        import gymnasium as gym

        self.env = gym.make("CartPole-v1")
        self.obs, _ = self.env.reset(seed=seed)
        self.settings = settings
        self.episode_return = 0.0

    def rollout(self, policy: Policy) -> dict[str, torch.Tensor]:
        s, n = self.settings, self.settings.rollout
        obs = torch.zeros(n, OBS)
        actions = torch.zeros(n, dtype=torch.int64)
        logps, values, rewards = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        nonterminal, ended = torch.zeros(n), torch.zeros(n)
        bootstrap = torch.zeros(n)  # the value of the next state when an episode is truncated
        with torch.no_grad():
            for t in range(n):
                obs[t] = torch.as_tensor(self.obs, dtype=torch.float32)
                dist, value = policy(obs[t])
                action = dist.sample()
                actions[t], logps[t], values[t] = action, dist.log_prob(action), value
                self.obs, reward, terminated, truncated, _ = self.env.step(int(action))
                rewards[t] = reward
                self.episode_return += reward
                if terminated or truncated:
                    if truncated and not terminated:
                        bootstrap[t] = policy(torch.as_tensor(self.obs, dtype=torch.float32))[1]
                    ended[t] = self.episode_return
                    self.episode_return = 0.0
                    self.obs, _ = self.env.reset()
                else:
                    nonterminal[t] = 1.0
            next_value = policy(torch.as_tensor(self.obs, dtype=torch.float32))[1]
        advantages = torch.zeros(n)
        last = 0.0
        for t in reversed(range(n)):
            following = next_value if t == n - 1 else values[t + 1]
            delta = rewards[t] + s.gamma * (following * nonterminal[t] + bootstrap[t]) - values[t]
            last = delta + s.gamma * s.lam * nonterminal[t] * last
            advantages[t] = last
        return {
            "obs": obs,
            "action": actions,
            "logp": logps,
            "advantage": advantages,
            "ret": advantages + values,
            "episode_return": ended,
        }


class Learner:
    """PPO updates on batches of rollouts."""

    def __init__(self, settings: Settings) -> None:
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=settings.lr, eps=1e-5)
        self.steps = 0
        self.returns: list[float] = []

    def update(self, batches: list[dict[str, torch.Tensor]]) -> None:
        s = self.settings
        data = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        self.steps += len(data["obs"])
        self.returns += [r for r in data["episode_return"].tolist() if r > 0]
        for group in self.optimizer.param_groups:  # linear decay, as rl-zoo's PPO for CartPole
            group["lr"] = s.lr * max(0.05, 1.0 - self.steps / s.max_steps)
        adv = data["advantage"]
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        for _ in range(s.epochs):
            dist, value = self.policy(data["obs"])
            ratio = (dist.log_prob(data["action"]) - data["logp"]).exp()
            clipped = ratio.clamp(1 - s.clip, 1 + s.clip)
            policy_loss = -torch.min(ratio * adv, clipped * adv).mean()
            value_loss = ((value - data["ret"]) ** 2).mean()
            loss = policy_loss + 0.5 * value_loss
            self.optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(self.policy.parameters(), 0.5)
            self.optimizer.step()

    def recent_mean(self, n: int = 20) -> float:
        tail = self.returns[-n:]
        return sum(tail) / len(tail) if tail else 0.0


def evaluate(policy: Policy, episodes: int, seed: int = 10_000) -> float:
    """Mean return of the greedy policy over ``episodes`` episodes."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    total = 0.0
    with torch.no_grad():
        for e in range(episodes):
            obs, _ = env.reset(seed=seed + e)
            done = False
            while not done:
                action = int(policy.pi(torch.as_tensor(obs, dtype=torch.float32)).argmax())
                obs, reward, terminated, truncated, _ = env.step(action)
                total += reward
                done = terminated or truncated
    return total / episodes


def run_learner(
    address: str, secret: bytes, settings: Settings, log=print, on_update=None, may_stop=None
) -> dict:
    """Serve the queue at ``address``, train until the target or the step budget; return the
    figures (steps, seconds, evaluation, samples/s, staleness drops). ``on_update(version,
    queue)`` is called after each update; ``may_stop(queue)``, when given, must also be true
    for the target to end training (tests use both)."""
    torch.set_num_threads(1)
    learner = Learner(settings)
    started = time.monotonic()
    evaluation, last_check = 0.0, 0
    with (
        WeightPublisher(free_address(), secret) as publisher,
        SampleQueueServer(
            address,
            secret,
            SPEC,
            capacity=2 * settings.batch_rollouts,
            weights_address=publisher.address,
        ) as queue,
    ):
        version = publisher.publish_model(learner.policy)
        while learner.steps < settings.max_steps:
            batches: list[dict[str, torch.Tensor]] = []
            while len(batches) < settings.batch_rollouts:
                batch = queue.get(timeout_s=5.0, min_version=version - settings.max_lag)
                if batch is not None:
                    batches.append(batch.tensors)
                elif time.monotonic() - started > 30 and not queue.actors:
                    raise RuntimeError("no actor said hello within 30 s")
            learner.update(batches)
            version = publisher.publish_model(learner.policy, {"steps": learner.steps})
            if on_update is not None:
                on_update(version, queue)
            if version % 20 == 0:
                log(
                    f"learner: version {version} steps {learner.steps} recent return "
                    f"{learner.recent_mean():.1f} dropped stale {queue.dropped_stale} "
                    f"({learner.steps / (time.monotonic() - started):.0f} samples/s)"
                )
            if (
                learner.recent_mean() >= settings.target
                and learner.steps - last_check >= 5_000
                and (may_stop is None or may_stop(queue))
            ):
                last_check = learner.steps
                evaluation = evaluate(learner.policy, settings.eval_episodes)
                log(
                    f"learner: greedy evaluation at {learner.steps} steps: {evaluation:.1f} over {settings.eval_episodes} episodes"
                )
                if evaluation >= settings.target:
                    break
        seconds = time.monotonic() - started
        if evaluation < settings.target:
            evaluation = evaluate(learner.policy, settings.eval_episodes)
        figures = {
            "steps": learner.steps,
            "seconds": round(seconds, 1),
            "samples_per_s": round(learner.steps / seconds, 1),
            "evaluation": evaluation,
            "eval_episodes": settings.eval_episodes,
            "versions": version,
            "dropped_stale": queue.dropped_stale,
            "held_pushes": queue.held_pushes,
            "actors": sorted(queue.actors),
            "batches_by_actor": dict(queue.accepted_by),
        }
    log("learner: " + json.dumps(figures))
    return figures


def run_actor(address: str, secret: bytes, name: str, seed: int, settings: Settings) -> int:
    """Play and push rollouts until the learner goes away."""
    from tensorfleet.errors import DeadlineExceeded

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    client = ActorClient(address, secret, name)
    policy = Policy()
    roller = Roller(seed, settings)
    try:
        snapshot = client.newest_weights(wait_s=30)
        if snapshot is not None:
            policy.load_state_dict(snapshot.tensors)
        while True:
            version = client.version
            rollout = roller.rollout(policy)
            client.push(rollout, version)
            snapshot = client.newest_weights()  # every rollout: the newest weights, if any
            if snapshot is not None:
                policy.load_state_dict(snapshot.tensors)
    except DeadlineExceeded as exc:  # the learner is done (ConnectionLost too)
        print(f"{name}: the learner is gone ({exc}); {client.pushed} rollouts pushed", flush=True)
        return 0
    finally:
        client.close()


def run_single(settings: Settings, log=print) -> dict:
    """The baseline: one process that plays and learns in turn (no queue, no wire)."""
    torch.set_num_threads(1)
    learner = Learner(settings)
    roller = Roller(settings.seed, settings)
    started = time.monotonic()
    while learner.steps < settings.max_steps:
        learner.update([roller.rollout(learner.policy) for _ in range(settings.batch_rollouts)])
    seconds = time.monotonic() - started
    figures = {
        "steps": learner.steps,
        "seconds": round(seconds, 1),
        "samples_per_s": round(learner.steps / seconds, 1),
    }
    log("single: " + json.dumps(figures))
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--actors", type=int, default=2, help="actor processes to start (standalone)"
    )
    parser.add_argument("--single", action="store_true", help="one process doing both (baseline)")
    parser.add_argument("--role", choices=("actor",), help=argparse.SUPPRESS)
    parser.add_argument("--learner", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="actor", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=Settings.max_steps)
    parser.add_argument("--target", type=float, default=Settings.target)
    parser.add_argument("--eval-episodes", type=int, default=Settings.eval_episodes)
    parser.add_argument("--max-lag", type=int, default=Settings.max_lag)
    args = parser.parse_args()
    settings = Settings(
        seed=args.seed,
        max_steps=args.max_steps,
        target=args.target,
        eval_episodes=args.eval_episodes,
        max_lag=args.max_lag,
    )
    if args.single:
        run_single(settings)
        return 0
    if args.role == "actor":
        return run_actor(
            args.learner, os.environ["TENSORFLEET_SECRET"].encode(), args.name, args.seed, settings
        )
    tf_config = os.environ.get("TF_CONFIG")
    if tf_config:  # under the launcher: worker 0 learns, the others act
        from tensorfleet.cluster.resolver import resolve_task

        task = resolve_task(argv=[])
        learner_address = task.cluster.task_address("worker", 0)
        secret = os.environ["TENSORFLEET_SECRET"].encode()
        if task.index == 0:
            run_learner(learner_address, secret, settings)
            return 0
        return run_actor(
            learner_address, secret, f"worker:{task.index}", settings.seed + task.index, settings
        )
    # Standalone: start the actors as child processes.
    secret = secrets.token_hex(32)
    address = free_address()
    env = dict(os.environ, TENSORFLEET_SECRET=secret)
    actors = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                "actor",
                "--learner",
                address,
                "--name",
                f"actor:{i}",
                "--seed",
                str(args.seed + 1 + i),
            ],
            env=env,
        )
        for i in range(args.actors)
    ]
    try:
        figures = run_learner(address, secret.encode(), settings)
    finally:
        for actor in actors:
            try:
                actor.wait(timeout=30)
            except subprocess.TimeoutExpired:
                actor.kill()
                actor.wait()
    return 0 if figures["evaluation"] >= settings.target else 1


if __name__ == "__main__":
    raise SystemExit(main())
