"""The small pieces every layer above may use and that use nothing of flowrl: where a frozen model runs
(``devices``), seeds (``seeding``), FSDP2's gather and slice (``sharded``), safe reads and the mode of exported files
(``safe_io``), image and video files (``media``)."""
