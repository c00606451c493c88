"""Issuing IDs: the generator (:mod:`.generator`), its restart safety (:mod:`.statefile`), what can go
wrong (:mod:`.errors`) and the one object every front end asks for IDs (:mod:`.issuer`)."""
