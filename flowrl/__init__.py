"""flowrl: reinforcement-learning alignment for flow-matching text-to-image models.

Importing the package is cheap: it pulls in no reward models and no torch-heavy
submodules. Import what you need from the submodules (``flowrl.sampling``,
``flowrl.models``, ``flowrl.recipes``).
"""

__version__ = "0.1.0"
