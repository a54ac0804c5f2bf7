"""Distributed policy-gradient training in the style of an actor-learner
setup, with the collectives PyTorch documents: each rank is an actor that
rolls out a batch of episodes of a small control task (a point pushed
towards a goal on a plane, done when it gets there or after at most 8
moves, so episodes end at different lengths) with the current policy
(sampling its actions, no gradients); the ranks then exchange their
trajectories, padded to the longest possible episode, with
``all_gather_single`` (named ``all_gather_into_tensor`` before torch 2.13):
observations, actions and rewards, and the episodes' lengths the same way.
Each rank computes the discounted returns of every actor's episodes,
normalises them over the whole gathered batch (one baseline for all), and,
as a learner, takes a REINFORCE update of the policy (an MLP under DDP, its
gradients all-reduced) on every fourth episode of the gathered batch,
starting at its own rank (so each learner sees every actor's episodes),
masked beyond each episode's length; Adam. The rollouts draw from
generators of their own, seeded by rank.

    PYTHONPATH=tests/zoo python tests/zoo_heldout9/rl_rollout_gather.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Step, grow, main

OBSERVATION, ACTIONS, HIDDEN = 4, 4, 256  # position and goal; four moves
EPISODES, HORIZON = 16, 8  # per actor, per round; the longest episode
GAMMA, REACHED = 0.97, 0.2
MOVES = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]) * 0.2
# returns[:, t] = sum over u >= t of GAMMA ** (u - t) * rewards[:, u]: one matmul
DISCOUNTS = torch.triu(GAMMA ** (torch.arange(HORIZON).view(1, -1)
                                 - torch.arange(HORIZON).view(-1, 1)).clamp(min=0).float())


class Policy(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.net = nn.Sequential(nn.Linear(OBSERVATION, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, ACTIONS))

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        # in the update the slowed rank scores extra observations
        return self.net(grow(observations, self.rank, self.opts))[:len(observations)]


@torch.no_grad()
def rollout(policy: Policy, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A batch of episodes, padded to ``HORIZON``: observations, actions,
    rewards (a tenth of the distance to the goal, negated, per move, and 1 on
    reaching it) and lengths."""
    position = torch.rand(EPISODES, 2, generator=g) * 2 - 1
    goal = position + torch.rand(EPISODES, 2, generator=g) - 0.5
    observations: list[torch.Tensor] = []
    actions: list[torch.Tensor] = []
    rewards: list[torch.Tensor] = []
    lengths = torch.zeros(EPISODES)
    running = torch.ones(EPISODES)  # 1 until the episode ends
    for _ in range(HORIZON):
        observation = torch.cat([position, goal], 1)
        cumulative = torch.softmax(policy.net(observation), -1).cumsum(-1)
        # an action drawn by its probability: the first whose cumulative
        # probability passes a uniform draw
        drawn = torch.rand(EPISODES, 1, generator=g)
        action = (cumulative < drawn).sum(-1).clamp(max=ACTIONS - 1)
        position = position + MOVES[action] * running.unsqueeze(1)
        distance = (position - goal).norm(dim=1)
        reached = (distance < REACHED).float()
        observations.append(observation)
        actions.append(action)
        rewards.append((reached - 0.1 * distance) * running)
        lengths += running
        running = running * (1 - reached)
        if running.sum() == 0:
            break
    padding = HORIZON - len(actions)  # (after the moves, zeros)
    return (F.pad(torch.stack(observations, 1), (0, 0, 0, padding)),
            F.pad(torch.stack(actions, 1), (0, padding)),
            F.pad(torch.stack(rewards, 1), (0, padding)), lengths.long())


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor``, stacked along the first dimension."""
    out = tensor.new_empty(dist.get_world_size() * tensor.shape[0], *tensor.shape[1:])
    dist.all_gather_single(out, tensor.contiguous())
    return out


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(Policy(rank, opts))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    world = dist.get_world_size()

    def step(_: int) -> None:
        observations, actions, rewards, lengths = map(gathered, rollout(model.module, g))
        mask = torch.arange(HORIZON) < lengths.unsqueeze(1)
        value = rewards @ DISCOUNTS.T  # discounted returns to each episode's end
        advantage = (value - value[mask].mean()) / (value[mask].std() + 1e-6)
        mine = slice(rank, None, world)
        logits = model(observations[mine].flatten(0, 1)).view(-1, HORIZON, ACTIONS)
        chosen = torch.log_softmax(logits, -1).gather(2, actions[mine].unsqueeze(2)).squeeze(2)
        optimizer.zero_grad()
        (-(chosen * advantage[mine] * mask[mine]).sum() / mask[mine].sum()).backward()
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0]))
