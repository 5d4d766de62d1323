"""Integrations with training frameworks (optional extras, imported only when asked for):

- ``swarmtrain.integrations.huggingface``: make a ``transformers.Trainer`` collaborative
  (``pip install swarmtrain[hf]``);
- ``swarmtrain.integrations.lightning``: a Lightning ``Strategy`` (``pip install
  swarmtrain[lightning]``).

Importing this package imports neither framework.
"""
