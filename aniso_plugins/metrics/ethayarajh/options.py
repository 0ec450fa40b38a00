"""The options of Ethayarajh's self-similarity and intra-sentence similarity, docs/methods.md §7.1: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from aniso_plugins.core.options import Options, check_positive_int


@dataclass(frozen=True)
class EthayarajhOptions(Options):
    """Ethayarajh's self-similarity and intra-sentence similarity."""


    ethayarajh_words: int = 256
    """Most frequent repeated tokens of the measured micro-batch kept for SelfSim ("ethayarajh")."""

    def validate(self) -> None:
        check_positive_int("ethayarajh_words", self.ethayarajh_words)


__all__ = ["EthayarajhOptions"]
