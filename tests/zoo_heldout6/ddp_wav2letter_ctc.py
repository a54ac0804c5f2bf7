"""Speech recognition with a CTC loss under DDP, as users write it after
torchaudio's ``Wav2Letter`` model and its speech-recognition tutorials: a
fully convolutional acoustic model over spectral features (a strided 1-d
convolution with a wide kernel, a stack of 1-d convolutions, a wider one
with a long kernel, then 1x1 convolutions to a score per character and
frame; ReLUs between; narrower and shallower than the paper's, to keep the
job small), log-softmax over the characters, and the connectionist temporal
classification loss (``F.ctc_loss``, a blank symbol, the utterances' and
transcripts' own lengths) against the transcripts; Adam (fused) with the
gradients' norm clipped. Utterances (features, padded transcripts, their
lengths) a DataLoader reads with a DistributedSampler.

    PYTHONPATH=tests/zoo python tests/zoo_heldout6/ddp_wav2letter_ctc.py --out DIR
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launch import Options, Rows, Step, batches, grow, main

FEATURES, CHARACTERS, WIDTH, WIDE, FRAMES, BATCH, UTTERANCES = 40, 29, 96, 192, 128, 8, 1024
BLANK = 0  # the CTC blank; characters are 1 .. CHARACTERS - 1
SHORTEST, LONGEST = 6, 20  # characters per transcript
HOLD = (3, 6)  # frames per character (at least, below)


class Wav2Letter(nn.Module):
    def __init__(self, rank: int, opts: Options) -> None:
        super().__init__()
        self.rank, self.opts = rank, opts
        self.acoustic = nn.Sequential(
            nn.Conv1d(FEATURES, WIDTH, 32, stride=2, padding=15), nn.ReLU(inplace=True),
            *(layer for _ in range(2) for layer in
              (nn.Conv1d(WIDTH, WIDTH, 7, padding=3), nn.ReLU(inplace=True))),
            nn.Conv1d(WIDTH, WIDE, 11, padding=5), nn.ReLU(inplace=True),
            nn.Conv1d(WIDE, WIDE, 1), nn.ReLU(inplace=True),
            nn.Conv1d(WIDE, CHARACTERS, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # the slowed rank recognises extra utterances
        scores = self.acoustic(grow(features, self.rank, self.opts))[:len(features)]
        return F.log_softmax(scores, dim=1)  # (batch, characters, frames)


def utterances() -> Rows:
    """Transcripts of random characters and their "recordings": each
    character a spectral template of its own held for a few frames, with
    noise; silence (noise alone) pads each recording."""
    g = torch.Generator().manual_seed(0)
    templates = torch.randn(CHARACTERS, FEATURES, generator=g)
    lengths = torch.randint(SHORTEST, LONGEST + 1, (UTTERANCES,), generator=g)
    transcripts = torch.zeros(UTTERANCES, LONGEST, dtype=torch.long)
    features = 0.5 * torch.randn(UTTERANCES, FEATURES, FRAMES, generator=g)
    frames = torch.zeros(UTTERANCES, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        characters = torch.randint(1, CHARACTERS, (n,), generator=g)
        held = torch.randint(*HOLD, (n,), generator=g)
        transcripts[i, :n] = characters
        spoken = templates[characters.repeat_interleave(held)].T
        features[i, :, :spoken.shape[1]] += spoken
        frames[i] = spoken.shape[1]
    return Rows(features, transcripts, lengths, frames)


def build(rank: int, opts: Options) -> Step:
    torch.manual_seed(0)
    model = DistributedDataParallel(Wav2Letter(rank, opts))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    data = batches(utterances(), rank, opts, BATCH)

    def step(_: int) -> None:
        features, transcripts, lengths, frames = next(data)
        optimizer.zero_grad()
        log_probs = model(features).permute(2, 0, 1)  # (frames, batch, characters)
        heard = (frames + 1) // 2  # the first convolution's stride halves the frames
        F.ctc_loss(log_probs, transcripts, heard, lengths, blank=BLANK,
                   zero_infinity=True).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
    return step


if __name__ == "__main__":
    sys.exit(main(build, __doc__.splitlines()[0], own_loader=True))
