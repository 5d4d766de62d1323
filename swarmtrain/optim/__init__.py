"""swarmtrain.optim: decentralized optimizers and the training-progress tracker they share."""

from swarmtrain.optim.async_diloco import AsyncDiLoCoOptimizer as AsyncDiLoCoOptimizer
from swarmtrain.optim.async_optimizer import AsyncOptimizer as AsyncOptimizer
from swarmtrain.optim.async_state_averager import (
    AsyncTrainingStateAverager as AsyncTrainingStateAverager,
)
from swarmtrain.optim.diloco import DiLoCoOptimizer as DiLoCoOptimizer
from swarmtrain.optim.diloco import DiLoCoStatistics as DiLoCoStatistics
from swarmtrain.optim.diloco import RoundStatistics as RoundStatistics
from swarmtrain.optim.diloco_core import ApplyOuter as ApplyOuter
from swarmtrain.optim.diloco_core import Fragments as Fragments
from swarmtrain.optim.diloco_core import OuterState as OuterState
from swarmtrain.optim.diloco_core import StartSync as StartSync
from swarmtrain.optim.diloco_core import StreamingSchedule as StreamingSchedule
from swarmtrain.optim.diloco_core import default_outer_optimizer as default_outer_optimizer
from swarmtrain.optim.diloco_core import mix_ as mix_
from swarmtrain.optim.grad_averager import GradientAverager as GradientAverager
from swarmtrain.optim.grad_scaler import GradScaler as GradScaler
from swarmtrain.optim.optimizer import Optimizer as Optimizer
from swarmtrain.optim.power_sgd import PowerSGDGradientAverager as PowerSGDGradientAverager
from swarmtrain.optim.process_grad_averager import (
    ProcessGradientAverager as ProcessGradientAverager,
)
from swarmtrain.optim.state_averager import TrainingStateAverager as TrainingStateAverager

from .progress_core import ProgressCore as ProgressCore
from .progress_records import LocalProgressSchema as LocalProgressSchema
from .progress_records import ProgressTrackerStatistics as ProgressTrackerStatistics
from .progress_records import TrainingProgressSchema as TrainingProgressSchema
from .progress_tracker import AsyncProgressTracker as AsyncProgressTracker
from .progress_tracker_blocking import ProgressTracker as ProgressTracker
from .progress_types import ClockSkewDetected as ClockSkewDetected
from .progress_types import GlobalProgress as GlobalProgress
from .progress_types import ImplausibleProgress as ImplausibleProgress
from .progress_types import LocalProgress as LocalProgress
from .progress_types import LonePeer as LonePeer
from .progress_types import PerformanceEMA as PerformanceEMA
from .progress_types import ProgressConfig as ProgressConfig
from .progress_types import ProgressWarning as ProgressWarning
from .progress_types import TargetNotReached as TargetNotReached
