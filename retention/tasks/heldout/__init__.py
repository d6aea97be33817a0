"""Held-out task families (issue 74): templates, key and value types, question wording, intros, answer prefixes,
haystack genres and turn structures that no training source uses, so a score on them says how gates do on formats
they never saw.

===============  ============================================================================================
``prose_facts``  facts as natural sentences (a birthplace, a year, a code, an amount) in news prose, no warning
``records``      a record of a table, a config file or a log, asked by its key
``late_recall``  a detail from the first turn, asked after many turns about news articles
``ruler_niah``   RULER's needle task in RULER's wording, word-pair keys, over Wikipedia prose
``span_cloze``   a sentence of a Wikipedia article quoted with a name or number blanked
``fidelity_news`` / ``fidelity_wiki``  next-token fidelity on the held-out genres
===============  ============================================================================================

Every family is evaluation only: training configs refuse them (``retention.train.config``), and their genres
(:mod:`.corpora`) have no training split. The generators are registered in :data:`retention.tasks.TASKS`; this
package's ``__init__`` imports none of them, since :mod:`retention.tasks.haystack` reads :mod:`.corpora`.
"""
