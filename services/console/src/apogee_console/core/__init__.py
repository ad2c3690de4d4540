"""What the console knows, free of HTTP: the cluster's views (:mod:`.cluster`), message bodies
(:mod:`.views`), sampled series (:mod:`.sampling`, :mod:`.prometheus`) and access
(:mod:`.access`)."""
