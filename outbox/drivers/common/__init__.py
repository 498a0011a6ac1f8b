"""SQLAlchemy Core code that runs the same on every backend the toolkit ships a driver for.

A driver class is these classes put together (`CommonDriver`), with its backend's
pieces (`DriverPieces`'s abstract methods) and its own versions of the statements
that differ (PostgreSQL's receipt insert and claims; each backend's settle, task
results and renewals). A backend that differs more overrides more.
"""

from __future__ import annotations

from outbox.drivers.common.announcements import AnnouncementStatements
from outbox.drivers.common.backlog_samples import BacklogSampleStatements
from outbox.drivers.common.claims import ClaimStatements
from outbox.drivers.common.console import ConsoleStatements
from outbox.drivers.common.dead_letters import DeadLetterStatements
from outbox.drivers.common.failed_attempts import FailedAttemptReads
from outbox.drivers.common.figures import FigureReads
from outbox.drivers.common.leases import LeaseStatements
from outbox.drivers.common.message_lists import MessageListStatements
from outbox.drivers.common.messages import MessageStatements
from outbox.drivers.common.operations import OperationStatements
from outbox.drivers.common.pieces import DriverPieces
from outbox.drivers.common.receipts import ReceiptStatements
from outbox.drivers.common.settle import SettleReads
from outbox.drivers.common.task_claims import TaskClaimStatements
from outbox.drivers.common.task_decisions import TaskDecisionStatements
from outbox.drivers.common.task_intake import TaskIntakeStatements
from outbox.drivers.common.task_lists import TaskListStatements
from outbox.drivers.common.task_reconcile import TaskReconcileStatements
from outbox.drivers.common.task_renewals import TaskRenewalStatements
from outbox.drivers.common.task_results import TaskResultStatements
from outbox.drivers.common.task_transitions import TaskTransitionStatements


class CommonDriver(
    ReceiptStatements,
    DeadLetterStatements,
    MessageStatements,
    OperationStatements,
    ConsoleStatements,
    MessageListStatements,
    TaskListStatements,
    TaskDecisionStatements,
    ClaimStatements,
    LeaseStatements,
    SettleReads,
    FailedAttemptReads,
    AnnouncementStatements,
    FigureReads,
    BacklogSampleStatements,
    TaskIntakeStatements,
    TaskClaimStatements,
    TaskTransitionStatements,
    TaskRenewalStatements,
    TaskResultStatements,
    TaskReconcileStatements,
    DriverPieces,
):
    """Every family in portable Core; a backend's class adds its pieces."""


__all__ = ["CommonDriver", "DriverPieces"]
