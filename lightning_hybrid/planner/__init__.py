"""Planner: memory and step time of every layout, the search, the Young/Daly interval, and the ``plan`` CLI."""
