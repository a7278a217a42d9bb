"""Drafters propose tokens; they never touch the target.

base.py: the `Draft` a drafter returns and the `Drafter` protocol the loop asks of it; model.py: the draft
model (`DraftModel`, chains of draft passes); copy.py: following a text the output repeats through its edits
(`Alignment`: a prediction, the prompt); pld.py: prompt lookup (`PromptLookup`); lookup.py: the lookup
drafter (`Lookup`, trees of guesses) over its sources: the n-gram tables of sources.py (the context, the
engine's `History`) and the `Datastore` of datastore.py. The tree drafter that combines the draft model and
the lookup guesses on the measured costs is tree.TreeDrafter. A new drafter: a module here with a class
that implements `Drafter`, and its entry in the method table (methods.py).
"""
from .base import Draft, Drafter, fit_vocab
from .copy import Alignment, CopyGuess, followed
from .datastore import Datastore, build_datastore, index_files, tokenizer_fingerprint
from .lookup import SOURCES, Guess, Lookup
from .model import CATCHUP_APART, DRAFT_WINDOW, DraftModel, check_compatible
from .pld import PromptLookup
from .sources import History, NgramIndex

__all__ = ["Alignment", "CopyGuess", "followed", "Draft", "Drafter", "fit_vocab", "DraftModel", "DRAFT_WINDOW", "CATCHUP_APART", "check_compatible", "PromptLookup",
           "Lookup", "Guess", "SOURCES", "History", "NgramIndex", "Datastore", "build_datastore", "index_files",
           "tokenizer_fingerprint"]
