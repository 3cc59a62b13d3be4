"""Real English prose for the demo, the TTFT bench and the codec accuracy figures.

Why real text: a trained model attends very differently to text it understands than to random
token ids (sharp heads, attention sinks, outlier channels), and those are what lossy codecs get
wrong; and a demo whose chat makes sense shows what reuse is for. The passages are original
prose on varied topics (so heads see varied context), written for this project.
"""

from __future__ import annotations

PASSAGES: tuple[str, ...] = (
    "The river had been rising for three days before anyone in the village took it seriously. "
    "Old Marta said she had seen it like this once, when she was a girl, and that the water had "
    "come right up to the church steps before it turned back. The younger farmers laughed at "
    "first, but by the third evening they were carrying sandbags from the mill and stacking them "
    "along the low wall by the bakery. Children were sent to fetch rope and lanterns, and the "
    "schoolteacher opened the hall on the hill so that families from the lower streets would "
    "have somewhere dry to sleep. Nobody spoke much. The rain kept falling in long grey sheets, "
    "and the sound of the water under the bridge grew from a murmur into a steady roar.",
    "A hash table stores key and value pairs in an array of buckets. To insert a pair, the table "
    "computes a hash of the key, reduces it modulo the number of buckets, and places the pair in "
    "that bucket. When two keys land in the same bucket the table must resolve the collision, "
    "either by chaining entries in a small list or by probing nearby buckets until an empty one "
    "is found. As the table fills, collisions become more frequent and lookups slow down, so "
    "most implementations grow the array and rehash every entry once the load factor passes a "
    "threshold. A good hash function spreads keys evenly, is cheap to compute, and, when keys "
    "may be chosen by an attacker, resists deliberate collisions.",
    "Photosynthesis takes place mainly in the leaves of green plants, inside small structures "
    "called chloroplasts. Chlorophyll absorbs red and blue light and reflects green, which is "
    "why leaves look green to us. The energy of the absorbed light splits water molecules, "
    "releasing oxygen into the air, and drives the production of energy carrying molecules. In "
    "a second set of reactions, which do not need light directly, the plant uses that stored "
    "energy to turn carbon dioxide from the air into sugars. These sugars feed the plant and, "
    "through the food chain, nearly every animal on Earth, including us.",
    "When the committee met on Tuesday, the first item on the agenda was the budget for the "
    "coming year. The treasurer explained that heating costs had nearly doubled and that the "
    "library roof would need repairs before winter. Several members asked whether the summer "
    "festival could be scaled back to save money, but others argued that the festival brought "
    "visitors and helped the shops on the high street. After a long discussion they agreed to "
    "keep the festival, ask local businesses for sponsorship, and postpone the new benches for "
    "the park until the following spring.",
    "Bread begins with four ingredients: flour, water, salt and yeast. When the flour is wet, "
    "two of its proteins join into long elastic strands of gluten, and kneading lines those "
    "strands up into a net that can trap gas. The yeast feeds on sugars in the dough and "
    "releases carbon dioxide and a little alcohol, so the dough slowly swells. A long, cool "
    "rise gives the yeast and the bacteria that travel with it time to build flavour. In the "
    "oven the trapped gas expands, the water turns to steam, and the outside dries and browns "
    "into a crust while the inside sets into a soft, open crumb.",
    "The lighthouse keeper kept a logbook for forty years. Most entries are short: the wind, "
    "the state of the sea, the ships that passed and the hours the lamp was lit. Now and then "
    "he wrote more. One winter he described a storm that tore the door off the oil store and "
    "carried it halfway down the cliff. Another year he noted the first swallows, a seal that "
    "slept on the landing stage for a week, and a rowing boat of students who had lost their "
    "way in the fog and followed the sound of his bell until they reached the harbour.",
    "A compiler turns the text of a program into instructions a machine can run. It first "
    "splits the text into tokens, then parses the tokens into a tree that reflects the "
    "structure of the program: functions, loops, expressions. Later passes check that the "
    "types fit together, simplify the tree, and translate it into an intermediate form that is "
    "easier to optimise. The optimiser removes work whose result is never used, moves "
    "calculations out of loops, and keeps busy values in registers. Finally the back end picks "
    "real machine instructions and lays them out in memory.",
    "Migrating birds cover astonishing distances. The arctic tern flies from the far north to "
    "the edge of Antarctica and back every year, and some small songbirds cross the Sahara "
    "without stopping to eat. Birds find their way with several senses at once: they read the "
    "position of the sun and, at night, the rotation of the stars; they sense the Earth's "
    "magnetic field; and near the end of the journey they recognise coastlines, rivers and even "
    "smells. Young birds of many species make their first journey alone and still arrive.",
    "The museum's new exhibition tells the history of the city through ordinary objects. There "
    "is a pair of leather boots worn by a postman for thirty years, a tram ticket from the day "
    "the last horse-drawn tram was retired, and a school exercise book in which a child copied "
    "out the same sentence a hundred times. Visitors are invited to bring their own objects and "
    "to write a short note about them. The curators say the notes are often more moving than "
    "the objects, because they explain why something small was worth keeping.",
    "Good sleep depends on a regular rhythm more than on any single trick. The body keeps an "
    "internal clock of roughly twenty four hours, set each morning mainly by daylight. In the "
    "evening, as light fades, the brain releases melatonin and body temperature begins to fall, "
    "which makes it easier to fall asleep. Bright screens late at night, heavy meals, and "
    "coffee in the afternoon all push that clock later. Going to bed and getting up at the "
    "same times every day, even at weekends, is the simplest way to keep it steady.",
    "The team had three weeks to move the old billing system onto the new servers. They began "
    "by writing down every job the system ran at night and every report the accountants "
    "relied on. Then they ran both systems side by side for a fortnight and compared the "
    "results line by line each morning. Most differences turned out to be rounding, but one "
    "revealed that the old system had been charging a small group of customers twice for "
    "late payments since a change made six years earlier. They fixed it before the switch.",
    "On the first warm day of spring the allotments fill with people. Some arrive with neat "
    "plans drawn on squared paper, rows of onions here and beans there, while others simply "
    "scatter seeds and see what comes up. Neighbours trade seedlings over the fences, argue "
    "about the best way to stop slugs, and share tea from a dented kettle in the shed. By "
    "midsummer the paths are narrow between towers of runner beans, and everyone has more "
    "courgettes than they know what to do with.",
)


def document(n_passages: int | None = None, start: int = 0) -> str:
    """The passages joined as one document, starting at passage `start` (wrapping around), so
    callers get different real contexts of the same length."""
    n = len(PASSAGES) if n_passages is None else n_passages
    return "\n\n".join(PASSAGES[(start + i) % len(PASSAGES)] for i in range(n))


QUESTIONS: tuple[str, ...] = (
    "Summarise the story about the river in two sentences.",
    "How does a hash table handle two keys that land in the same bucket?",
    "Why do leaves look green?",
    "What did the committee decide about the summer festival?",
    "What makes bread rise?",
    "What did the lighthouse keeper write about the students in the fog?",
    "Name the main passes of a compiler.",
    "How do migrating birds find their way?",
    "What can visitors bring to the museum exhibition?",
    "What is the simplest way to keep a steady sleep rhythm?",
    "What did the team discover while moving the billing system?",
    "What do neighbours do at the allotments in spring?",
)
