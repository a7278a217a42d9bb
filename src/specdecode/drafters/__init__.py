"""Drafters propose tokens; they never touch the target.

base.py: the `Draft` a drafter returns and the `Drafter` protocol the loop asks of it; model.py: the draft
model (`DraftModel`, chains of draft passes); copy.py: following a text the output repeats through its edits
(`Alignment`: a prediction, the prompt); pld.py: prompt lookup (`PromptLookup`); lookup.py: the lookup
drafter (`Lookup`, trees of guesses) over its sources: the n-gram tables of sources.py (the context, the
engine's `History`) and the `Datastore` of datastore.py. The tree drafter that combines the draft model and
the lookup guesses on the measured costs is tree.TreeDrafter. A new drafter: a module here with a class
that implements `Drafter`, and its entry in the method table (methods.py).

The names load on first use (PEP 562): the command line's parsers read DRAFT_WINDOW without torch.
"""

from __future__ import annotations

from ..lazy import lazy_names

# tokens of context the draft model sees (see DraftModel.window; --draft-window). Summaries, document questions,
# code edits and translations follow the document from its start, which a trailing window cuts off (measured:
# docs/results/notes.md#the-drafts-window), so the window only bounds what a very long text costs the draft.
DRAFT_WINDOW = 4096

_EXPORTS = {
    **dict.fromkeys(("Draft", "Drafter", "fit_vocab"), ".base"),
    **dict.fromkeys(("Alignment", "CopyGuess", "followed"), ".copy"),
    **dict.fromkeys(("Datastore", "build_datastore", "index_files", "tokenizer_fingerprint"), ".datastore"),
    **dict.fromkeys(("SOURCES", "Guess", "Lookup"), ".lookup"),
    **dict.fromkeys(("CATCHUP_APART", "DraftModel", "check_compatible"), ".model"),
    "PromptLookup": ".pld",
    **dict.fromkeys(("History", "NgramIndex"), ".sources"),
}

__all__ = [
    "Alignment",
    "CopyGuess",
    "followed",
    "Draft",
    "Drafter",
    "fit_vocab",
    "DraftModel",
    "DRAFT_WINDOW",
    "CATCHUP_APART",
    "check_compatible",
    "PromptLookup",
    "Lookup",
    "Guess",
    "SOURCES",
    "History",
    "NgramIndex",
    "Datastore",
    "build_datastore",
    "index_files",
    "tokenizer_fingerprint",
]


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
