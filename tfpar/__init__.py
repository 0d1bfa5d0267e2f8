"""tfpar: data, tensor and pipeline parallelism for TensorFlow 2 / Keras 3.

>>> import tfpar
>>> tfpar.use_virtual_cpus(8)           # only for CPU tests and demos
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))
"""

from tfpar.layout import LayoutRules
from tfpar.mesh import Mesh, use_virtual_cpus
from tfpar.strategy import ParallelStrategy

__all__ = ["LayoutRules", "Mesh", "ParallelStrategy", "use_virtual_cpus"]
__version__ = "0.1.0"
