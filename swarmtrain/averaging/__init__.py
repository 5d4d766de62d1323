"""swarmtrain.averaging: load balancing, tensor partitioning and butterfly all-reduce."""

from swarmtrain.averaging.allreduce import AllReduceConfig as AllReduceConfig
from swarmtrain.averaging.allreduce import AllReduceResult as AllReduceResult
from swarmtrain.averaging.allreduce import AllReduceRunner as AllReduceRunner
from swarmtrain.averaging.allreduce import AllReduceService as AllReduceService
from swarmtrain.averaging.allreduce_core import AllReduceGroup as AllReduceGroup
from swarmtrain.averaging.allreduce_core import AveragingMode as AveragingMode
from swarmtrain.averaging.allreduce_core import Failure as Failure
from swarmtrain.averaging.averager import AsyncDecentralizedAverager as AsyncDecentralizedAverager
from swarmtrain.averaging.averager import DecentralizedAverager as DecentralizedAverager
from swarmtrain.averaging.averager_config import AveragerConfig as AveragerConfig
from swarmtrain.averaging.control import AveragingStage as AveragingStage
from swarmtrain.averaging.control import StepControl as StepControl
from swarmtrain.averaging.errors import AveragingError as AveragingError
from swarmtrain.averaging.errors import MatchmakingError as MatchmakingError
from swarmtrain.averaging.errors import NonFiniteError as NonFiniteError
from swarmtrain.averaging.load_balancing import NoReducerError as NoReducerError
from swarmtrain.averaging.load_balancing import load_balance_peers as load_balance_peers
from swarmtrain.averaging.load_balancing import optimize_fractions as optimize_fractions
from swarmtrain.averaging.matchmaking import Matchmaking as Matchmaking
from swarmtrain.averaging.matchmaking_core import FailureReason as FailureReason
from swarmtrain.averaging.matchmaking_core import MatchmakingConfig as MatchmakingConfig
from swarmtrain.averaging.matchmaking_core import MatchmakingCore as MatchmakingCore
from swarmtrain.averaging.matchmaking_core import next_group_bits as next_group_bits
from swarmtrain.averaging.process_averager import HelperProcessError as HelperProcessError
from swarmtrain.averaging.process_averager import ProcessAverager as ProcessAverager
from swarmtrain.averaging.process_averager import ProcessStepControl as ProcessStepControl
