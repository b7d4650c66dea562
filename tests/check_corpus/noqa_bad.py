# ruff: noqa
"""Suppressions: `# fsdp2gen: noqa FSDPxxx` silences that code on its line, and only that code."""

import torch

trusted = torch.load("mine.pt")  # fsdp2gen: noqa FSDP008
both = torch.load("mine.pt")  # fsdp2gen: noqa: FSDP001, FSDP008
other = torch.load("theirs.pt")  # fsdp2gen: noqa FSDP001  # expect: FSDP008
everything = torch.load("mine.pt")  # fsdp2gen: noqa
