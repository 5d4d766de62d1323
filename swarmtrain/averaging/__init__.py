"""swarmtrain.averaging: load balancing, tensor partitioning and butterfly all-reduce."""

from swarmtrain.averaging.allreduce import AllReduceConfig as AllReduceConfig
from swarmtrain.averaging.allreduce import AllReduceResult as AllReduceResult
from swarmtrain.averaging.allreduce import AllReduceRunner as AllReduceRunner
from swarmtrain.averaging.allreduce import AllReduceService as AllReduceService
from swarmtrain.averaging.allreduce_core import AllReduceGroup as AllReduceGroup
from swarmtrain.averaging.allreduce_core import AveragingMode as AveragingMode
from swarmtrain.averaging.allreduce_core import Failure as Failure
from swarmtrain.averaging.load_balancing import load_balance_peers as load_balance_peers
from swarmtrain.averaging.load_balancing import optimize_fractions as optimize_fractions
from swarmtrain.averaging.matchmaking_core import MatchmakingConfig as MatchmakingConfig
from swarmtrain.averaging.matchmaking_core import MatchmakingCore as MatchmakingCore
from swarmtrain.averaging.matchmaking_core import next_group_bits as next_group_bits
