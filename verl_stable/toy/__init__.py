"""The toy world the CPU runs and the lab train in: tiny tokenizer, model and data (:mod:`.assets`), toy tasks and
their reward (:mod:`.tasks`), a simulated user (:mod:`.interactions`), the ``verl-stable run`` launcher
(:mod:`.launch`) and the ``main_ppo`` subprocess it drives (:mod:`.trainer_process`)."""
