"""swarmtrain.optim: decentralized optimizers and the training-progress tracker they share."""

from .progress_core import ClockSkewDetected as ClockSkewDetected
from .progress_core import GlobalProgress as GlobalProgress
from .progress_core import LocalProgress as LocalProgress
from .progress_core import LonePeer as LonePeer
from .progress_core import PerformanceEMA as PerformanceEMA
from .progress_core import ProgressConfig as ProgressConfig
from .progress_core import ProgressCore as ProgressCore
from .progress_core import ProgressWarning as ProgressWarning
from .progress_core import TargetNotReached as TargetNotReached
from .progress_tracker import AsyncProgressTracker as AsyncProgressTracker
from .progress_tracker import LocalProgressSchema as LocalProgressSchema
from .progress_tracker import ProgressTracker as ProgressTracker
from .progress_tracker import ProgressTrackerStatistics as ProgressTrackerStatistics
from .progress_tracker import TrainingProgressSchema as TrainingProgressSchema
