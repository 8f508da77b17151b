"""Prompts whose answers copy their context: the copy-heavy and long-context workloads.

Copy-heavy: short edits of a given text (rename, rewrite, quote, restructure, correct), so
most of each answer repeats the prompt. Long-context: one document of 1,500+ tokens (a
handbook of varied sections: prose, a table, a schedule, a log, a procedure, code) with
questions whose answers quote or extract it. None of these texts appears in the tests.
"""

from __future__ import annotations

_PARAGRAPH = (
    "The harbour town woke slowly. Fishing boats came back before dawn, their decks stacked with crates of ice "
    "and silver fish, and the market stalls opened one by one as the bakers carried out trays of warm bread. "
    "By eight the square was full: children on their way to school, old men arguing about the weather, and "
    "tourists photographing the lighthouse that had guided ships into the bay for two hundred years."
)

_FUNCTION = '''def average_rating(reviews, minimum_votes):
    total = 0
    count = 0
    for review in reviews:
        if review["votes"] < minimum_votes:
            continue
        total += review["stars"]
        count += 1
    if count == 0:
        return None
    return round(total / count, 2)
'''

_CSV = (
    "name,city,age,team\nAlice,Paris,31,red\nBob,Berlin,27,blue\nCarla,Madrid,45,red\nDan,Oslo,38,green\n"
    "Eve,Rome,29,blue\nFrank,Vienna,52,green"
)

_JSON = (
    '[{"id": 1, "title": "Blue kettle", "price": 24.5, "in_stock": true},\n'
    ' {"id": 2, "title": "Oak chopping board", "price": 18.0, "in_stock": false},\n'
    ' {"id": 3, "title": "Linen apron", "price": 12.75, "in_stock": true},\n'
    ' {"id": 4, "title": "Cast iron pan", "price": 39.9, "in_stock": true}]'
)

_MISSPELT = (
    "Yesterday we recieved the new shipment of books for the libary. Unfortunatly, several boxes were "
    "damaged on the way, and the covers of about twenty books are torn. We have allready contacted the "
    "supplier, who promissed to send replacments by the end of next week. Untill then, the new titles "
    "will not be availble for borrowing."
)

_PRESENT_TENSE = (
    "Every morning Maria walks to the station, buys a newspaper and waits for the eight o'clock train. "
    "She reads the headlines while the train crosses the river, and she always looks up when it passes "
    "the old mill. At work she answers emails, meets her team and plans the week's deliveries."
)

#: Answers that are mostly their prompt: what lookups propose for free.
COPY_HEAVY_PROMPTS: tuple[str, ...] = (
    f"Rename the variable `total` to `star_sum` in this Python function. Return the whole function.\n\n{_FUNCTION}",
    f"Repeat the following paragraph exactly, word for word:\n\n{_PARAGRAPH}",
    f"Convert this CSV to a Markdown table:\n\n{_CSV}",
    f"Rewrite this JSON so that every object's key \"title\" becomes \"name\"; keep everything else:\n\n{_JSON}",
    f"Correct the spelling mistakes in this text and return the corrected text:\n\n{_MISSPELT}",
    f"Rewrite this paragraph in the past tense:\n\n{_PRESENT_TENSE}",
)

#: About 1,600 tokens of varied text (SmolLM2's tokenizer), so the prompts exceed 1,500 tokens.
LONG_DOCUMENT = """\
# Millbrook Community Water Cooperative: Operations Handbook

## 1. History

The Millbrook Community Water Cooperative was founded in 1952 by eleven farming families who were tired of \
hauling water from the river during the dry months. They dug the first well on the Hartley farm with a \
borrowed drilling rig and laid two kilometres of cast iron pipe by hand. In 1968 the cooperative built the \
Upper Fen reservoir, and in 1987 it bought the disused quarry at Stone Hollow and turned it into a second \
reservoir. Today the cooperative serves 4,310 households and 38 businesses across the valley, and it is still \
owned by its members: every household that pays the connection fee holds one share and one vote.

## 2. Governance

The cooperative is run by a board of seven directors, elected by the members at the annual general meeting \
in March. Directors serve three-year terms, and no director may serve more than three terms in a row. The \
board appoints the operations manager, who is responsible for the daily running of the plant, the staff and \
the budget. Any decision that raises the water rate by more than four percent must be approved by a vote of \
the members. Minutes of every board meeting are published on the notice board at the pump house within ten \
days of the meeting.

## 3. Reservoirs and wells

| Name | Type | Capacity (cubic metres) | Built | Notes |
|---|---|---|---|---|
| Hartley Well | borehole | 120 per hour | 1952 | original well, now a backup source |
| Upper Fen | reservoir | 310,000 | 1968 | main summer supply |
| Stone Hollow | reservoir | 540,000 | 1987 | former quarry, lined in 2004 |
| Ash Lane Well | borehole | 200 per hour | 1999 | feeds the east district directly |
| North Tank | storage tank | 4,500 | 2015 | steel tank above the school |

The reservoirs are inspected every spring by an external engineer. Upper Fen is drawn down first in summer \
because its water is softer and needs less treatment; Stone Hollow is kept above sixty percent until the end \
of August so that the valley has a reserve for a dry autumn.

## 4. Water treatment

Raw water passes through three stages before it reaches a tap. First, coarse screens remove leaves, fish and \
debris at the intake. Second, the water flows through four sand filters, each two metres deep, which are \
backwashed every thirty-six hours or sooner when the pressure drop across a filter exceeds 0.4 bar. Third, \
the water is disinfected with sodium hypochlorite and held in the contact tank for at least forty minutes.

Free chlorine is measured at the outlet of the contact tank every fifteen minutes by an online analyser, and \
by hand once per shift as a check on the analyser. The target is 0.5 milligrams per litre. If the free \
chlorine reading falls below 0.2 milligrams per litre, the operator on duty must close the outlet valve and \
switch the supply to the North Tank immediately. The operator must then call the operations manager and \
record the time, the reading and the action taken in the plant log before doing anything else.

## 5. Maintenance schedule

- Daily: read the flow meters, check the chlorine dosing pump, walk the intake screens.
- Weekly: calibrate the chlorine analyser against the hand test kit; test the backup generator for ten minutes.
- Monthly: inspect the pump bearings and grease them; clean the contact tank inlet baffles.
- Every six months: replace the dosing pump diaphragm; sample the raw water for pesticides.
- Every year: drain and inspect the North Tank; renew the sand in one of the four filters, in rotation.

Spare parts for the dosing pump are kept in the locked cabinet in the chemical store. The key is held by the \
operations manager and by the senior operator of each shift.

## 6. Incident report: the February 2019 main break

On the night of 12 February 2019, the 300 millimetre main under Ash Lane split during a hard frost. Pressure \
in the east district fell from 4.1 bar to 0.6 bar within twenty minutes, and about 900 households lost their \
supply. The night operator, Tomasz Kowal, saw the pressure alarm at 02:14 and isolated the broken section by \
closing valves V12 and V15 at 02:40. Bottled water was handed out from the community hall from 07:00. The \
repair crew replaced four metres of pipe and the supply was restored at 16:25 the same day. The review after \
the incident found that valve V15 had been hard to turn because it had not been exercised for six years. \
Since then every valve in the network is opened and closed once a year, and the dates are kept in the valve \
register.

## 7. Customer questions

**Why does my water sometimes look cloudy?** Cloudy water is almost always tiny air bubbles, which appear \
after work on the mains. Fill a glass and wait two minutes: if it clears from the bottom up, it is air and \
safe to drink.

**Who pays for a leak on my property?** The cooperative owns the pipes up to and including the meter. Pipes \
between the meter and the house belong to the member, who pays for their repair. The cooperative will lend a \
leak detector free of charge.

**How is the water rate set?** The board proposes a rate each January from the budget for the coming year. \
The rate has two parts: a fixed charge of 9.80 per month for each connection and 1.45 per cubic metre used.

## 8. Meter reading script

Operators upload meter readings with a short script. It rejects a reading that is lower than the previous \
one, because meters only count upwards:

```python
def check_reading(previous, current):
    if current < previous:
        raise ValueError(f"reading {current} is below the previous reading {previous}")
    return current - previous
```

## 9. Contacts

The operations manager is Helen Okafor, reachable at the pump house office on weekdays from 08:00 to 16:30. \
Out of hours, members should call the duty operator on the emergency line, which is answered day and night. \
Questions about bills go to the treasurer, Samuel Reyes, by letter or at the monthly open office on the first \
Saturday of each month.

## 10. Glossary

- **Backwash**: reversing the flow through a sand filter to lift out the dirt it has trapped.
- **Contact tank**: the tank where water is held after chlorine is added, so that the chlorine has time to work.
- **Free chlorine**: the chlorine left in the water that can still disinfect, measured in milligrams per litre.
- **Drawdown**: how far the level of a reservoir falls as water is taken from it.
- **Valve register**: the book in the pump house that lists every valve, where it is and when it was last exercised.
"""

#: Questions whose answers quote, summarise with quotes, or extract from `LONG_DOCUMENT`.
LONG_CONTEXT_QUESTIONS: tuple[str, ...] = (
    "Quote, word for word, what the handbook says the operator must do when the free chlorine reading falls "
    "below the minimum.",
    "Summarise the February 2019 incident report, quoting its most important sentences exactly.",
    "Extract the reservoirs and wells from the handbook as a Markdown table with the columns Name, Type, "
    "Capacity and Built.",
)

LONG_CONTEXT_PROMPTS: tuple[str, ...] = tuple(
    f"Read this handbook and answer the question after it.\n\n{LONG_DOCUMENT}\nQuestion: {question}"
    for question in LONG_CONTEXT_QUESTIONS
)
