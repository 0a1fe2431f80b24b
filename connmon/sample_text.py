"""A few English sentences, real text for a tokenizer when a reading needs one and the user gave none.

``connmon analyze minilm`` reads them by default, and ``examples/reproduce_paper.py`` measures the paper's findings
on them (docs/paper_findings.md): the walk part of the spectrum depends on the input, so random tokens say less
about a pretrained model than a sentence does.

Examples:
    >>> from connmon.sample_text import SENTENCES
    >>> len(SENTENCES), SENTENCES[0].split()[:3]
    (8, ['The', 'committee', 'postponed'])
"""

SENTENCES = [
    "The committee postponed the vote until the budget figures had been checked twice.",
    "A small boat drifted past the harbour lights while the fishermen mended their nets.",
    "Transformers read every token in the context before deciding what the next one should be.",
    "She planted tomatoes along the south wall, where the afternoon sun lingers longest.",
    "The museum reopened after renovation with a new wing devoted to early photography.",
    "Heavy rain flooded the lower streets, and the council opened the school as a shelter.",
    "He explained the proof slowly, drawing each step of the induction on the blackboard.",
    "The orchestra tuned for several minutes before the conductor finally raised her baton.",
]
