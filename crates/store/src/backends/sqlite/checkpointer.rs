//! SQLite's WAL checkpoints, copied into the database file off the writer's path.
//!
//! In WAL mode a commit appends its pages to the WAL; a checkpoint later copies them
//! into the database file and syncs it. By default the committing connection runs one
//! itself whenever the WAL passes 1,000 pages: on the hot path that was the writer
//! every ~20 reservation batches, inside the commit a batch's callers wait for, with
//! two more syncs (docs/BENCHMARKS.md, twenty-eighth session: 8 % of the writer
//! thread's time, and the batches behind it in the tail).
//!
//! Here a task of its own, on a connection of its own, runs a passive checkpoint a
//! short pause after the WAL grew: it never takes the write lock, so the writer goes on
//! committing while it copies. The writer still checkpoints itself past
//! [`WRITER_AUTOCHECKPOINT_PAGES`], as the bound on the WAL: SQLite rewinds the WAL only
//! when a writer begins and finds every frame copied, which a checkpoint running beside
//! a busy writer rarely leaves it, while the writer's own checkpoint right after its
//! commit does — and by then nearly every frame is copied already, so it copies few.
//! Durability does not change: a commit is on disk when its WAL frames are synced
//! (`synchronous=FULL`), before and after this.

use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::{ConnectOptions as _, Connection as _, Row as _};
use tokio::sync::{Notify, watch};

/// Past this many WAL pages the writer checkpoints after its commit (SQLite's
/// `wal_autocheckpoint`; its default is 1,000): with the task copying beside it, the
/// writer's own checkpoint is the WAL's bound, rarely reached while the task keeps up.
pub(crate) const WRITER_AUTOCHECKPOINT_PAGES: u32 = 2_000;

/// The pause after a step that found new frames: at most this long between a commit
/// and the copy of its pages (about seven reservation batches on a busy writer).
const PAUSE_WHILE_WRITING: Duration = Duration::from_millis(10);

/// The longest pause, reached by doubling while nothing is written: an idle server
/// wakes this task once a second.
const PAUSE_WHEN_IDLE_MAX: Duration = Duration::from_secs(1);

/// What `PRAGMA wal_checkpoint(PASSIVE)` answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WalProgress {
    /// Another checkpoint was running (another process's): this one copied nothing.
    pub(crate) busy: bool,
    /// Frames in the WAL (-1 when the database is not in WAL mode).
    pub(crate) log_frames: i64,
    /// Of those, frames copied into the database file (-1 likewise).
    pub(crate) checkpointed_frames: i64,
}

/// One passive checkpoint: copies every frame no reader still needs, without waiting
/// for a lock or holding one a writer needs.
pub(crate) async fn checkpoint_step(
    connection: &mut SqliteConnection,
) -> Result<WalProgress, sqlx::Error> {
    let row = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
        .fetch_one(connection)
        .await?;
    Ok(WalProgress {
        busy: row.try_get::<i64, _>(0)? != 0,
        log_frames: row.try_get(1)?,
        checkpointed_frames: row.try_get(2)?,
    })
}

/// The pause before the next step: short when this step found the WAL changed since
/// the last one (a commit came, or the writer rewound it), doubling up to
/// [`PAUSE_WHEN_IDLE_MAX`] while it stays as it was.
pub(crate) fn next_pause(
    previous_pause: Duration,
    last: Option<WalProgress>,
    now: WalProgress,
) -> Duration {
    if last != Some(now) {
        PAUSE_WHILE_WRITING
    } else {
        (previous_pause * 2).clamp(PAUSE_WHILE_WRITING, PAUSE_WHEN_IDLE_MAX)
    }
}

/// The running task; stopped when [`Checkpointer::stop`] is called or the last holder
/// drops it.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    stop: Arc<Notify>,
    /// What the last step answered (none before the first): the tests wait for a
    /// step with it instead of for a time.
    #[cfg_attr(not(test), allow(dead_code))]
    steps: watch::Receiver<Option<WalProgress>>,
    task: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Checkpointer {
    /// Opens the task's connection (read-write: a checkpoint writes the database file)
    /// and starts the task on the current runtime.
    pub(crate) async fn start(options: &SqliteConnectOptions) -> Result<Checkpointer, sqlx::Error> {
        let options = options.clone().read_only(false);
        let connection = options.connect().await?;
        let stop = Arc::new(Notify::new());
        let (step_sender, steps) = watch::channel(None);
        let task = tokio::spawn(run(options, connection, Arc::clone(&stop), step_sender));
        Ok(Checkpointer {
            stop,
            steps,
            task: tokio::sync::Mutex::new(Some(task)),
        })
    }

    /// Whether `condition` came to hold, checked now and after each step the task
    /// takes: false if the task stopped first, or after 30 s, a bound that only keeps
    /// a broken task from hanging the suite.
    #[cfg(test)]
    pub(crate) async fn wait_for_step(&self, mut condition: impl FnMut() -> bool) -> bool {
        let mut steps = self.steps.clone();
        // Reduced to a bool here: what `wait_for` answers holds the watch's read lock,
        // and a step the task took while a caller still held it would block on that
        // lock, and with it a current-thread runtime, where no timeout can fire.
        let condition_holds = steps.wait_for(|_| condition());
        matches!(
            tokio::time::timeout(Duration::from_secs(30), condition_holds).await,
            Ok(Ok(_))
        )
    }

    /// Stops the task and waits until it has closed its connection.
    pub(crate) async fn stop(&self) {
        self.stop.notify_one();
        if let Some(task) = self.task.lock().await.take() {
            // A task that panicked has stopped too.
            let _ = task.await;
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // `notify_one` keeps the signal for a task not waiting yet.
        self.stop.notify_one();
    }
}

async fn run(
    options: SqliteConnectOptions,
    connection: SqliteConnection,
    stop: Arc<Notify>,
    steps: watch::Sender<Option<WalProgress>>,
) {
    let mut connection = Some(connection);
    let mut pause = PAUSE_WHILE_WRITING;
    let mut last = None;
    loop {
        tokio::select! {
            () = stop.notified() => break,
            () = tokio::time::sleep(pause) => {}
        }
        if connection.is_none() {
            match options.connect().await {
                Ok(opened) => connection = Some(opened),
                Err(error) => {
                    tracing::warn!(%error, "cannot open the WAL checkpoint connection");
                    pause = PAUSE_WHEN_IDLE_MAX;
                    continue;
                }
            }
        }
        let Some(open) = connection.as_mut() else {
            continue;
        };
        match checkpoint_step(open).await {
            Ok(progress) => {
                pause = next_pause(pause, last, progress);
                last = Some(progress);
                steps.send_replace(last);
            }
            Err(error) => {
                // The writer's own checkpoints go on bounding the WAL meanwhile.
                tracing::warn!(%error, "a WAL checkpoint failed; reconnecting");
                connection = None;
                pause = PAUSE_WHEN_IDLE_MAX;
            }
        }
    }
    if let Some(connection) = connection {
        // Closing answers only how the close went; the connection is gone anyway.
        let _ = connection.close().await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::ConnectOptions as _;

    use super::*;
    use crate::backends::sqlite::writer::tests::DatabaseFile;

    /// A WAL database whose connections never checkpoint by themselves.
    fn without_autocheckpoint(file: &DatabaseFile) -> SqliteConnectOptions {
        file.options().pragma("wal_autocheckpoint", "0")
    }

    /// Commits `transactions` transactions of ten rows, each row about a page.
    async fn commit_rows(connection: &mut SqliteConnection, transactions: usize) {
        sqlx::query("CREATE TABLE IF NOT EXISTS filler (body BLOB NOT NULL)")
            .execute(&mut *connection)
            .await
            .unwrap();
        for _ in 0..transactions {
            sqlx::query(
                "WITH RECURSIVE row (number) AS (SELECT 1 UNION ALL SELECT number + 1 FROM row WHERE number < 10) \
                 INSERT INTO filler (body) SELECT randomblob(3000) FROM row",
            )
            .execute(&mut *connection)
            .await
            .unwrap();
        }
    }

    fn database_file_length(file: &DatabaseFile) -> u64 {
        std::fs::metadata(file.path())
            .map(|meta| meta.len())
            .unwrap()
    }

    #[tokio::test]
    async fn a_step_copies_every_committed_frame_into_the_database_file() {
        let file = DatabaseFile::new("checkpoint-step");
        let options = without_autocheckpoint(&file);
        let mut writer = options.connect().await.unwrap();
        commit_rows(&mut writer, 5).await;
        let before = database_file_length(&file);
        let mut checkpointer = options.connect().await.unwrap();

        let progress = checkpoint_step(&mut checkpointer).await.unwrap();

        assert!(!progress.busy);
        assert!(progress.log_frames >= 50, "{progress:?}");
        assert_eq!(progress.checkpointed_frames, progress.log_frames);
        assert!(
            database_file_length(&file) >= before + 50 * 3_000,
            "the database file grew from {before} to {} bytes",
            database_file_length(&file)
        );
    }

    #[test]
    fn the_pause_is_short_after_the_wal_changed_and_doubles_to_its_bound_while_it_stays() {
        let copied = |log_frames| WalProgress {
            busy: false,
            log_frames,
            checkpointed_frames: log_frames,
        };
        assert_eq!(
            next_pause(PAUSE_WHILE_WRITING, None, copied(0)),
            PAUSE_WHILE_WRITING
        );
        assert_eq!(
            next_pause(PAUSE_WHEN_IDLE_MAX, Some(copied(40)), copied(90)),
            PAUSE_WHILE_WRITING,
            "new frames"
        );
        assert_eq!(
            next_pause(PAUSE_WHEN_IDLE_MAX, Some(copied(900)), copied(45)),
            PAUSE_WHILE_WRITING,
            "the writer rewound the WAL"
        );
        let mut pause = PAUSE_WHILE_WRITING;
        let mut pauses = Vec::new();
        for _ in 0..10 {
            pause = next_pause(pause, Some(copied(90)), copied(90));
            pauses.push(pause.as_millis());
        }
        assert_eq!(pauses, [20, 40, 80, 160, 320, 640, 1000, 1000, 1000, 1000]);
    }

    #[tokio::test]
    async fn a_started_checkpointer_copies_what_the_writer_commits_and_stops_when_asked() {
        let file = DatabaseFile::new("checkpointer-task");
        let options = without_autocheckpoint(&file);
        let mut writer = options.connect().await.unwrap();
        commit_rows(&mut writer, 1).await;
        let checkpointer = Checkpointer::start(&options).await.unwrap();
        let before = database_file_length(&file);

        commit_rows(&mut writer, 5).await;

        let grown = checkpointer
            .wait_for_step(|| database_file_length(&file) >= before + 50 * 3_000)
            .await;
        assert!(grown, "nothing was copied into the database file");
        tokio::time::timeout(Duration::from_secs(30), checkpointer.stop())
            .await
            .expect("the task stops");
    }
}
