"""The help of the GPipe layer's `schedule` field names every schedule a user can choose, by its short name and its
class, so a schedule added to the table shows up in the help without an edit there."""

import re

from gpipe_tf.gpipe.pipeline import GPipe
from gpipe_tf.gpipe.schedules import SCHEDULES


def test_schedule_help_names_every_schedule():
    doc = GPipe.params().doc("schedule")
    missing = [f"'{name}' ({cls.__name__})" for name, cls in SCHEDULES.items()
               if f"'{name}'" not in doc or not re.search(rf"\b{cls.__name__}\b", doc)]
    assert len(SCHEDULES) >= 6, sorted(SCHEDULES)
    assert not missing, f"schedules the help of GPipe's schedule field leaves out: {missing}\n{doc}"
