//! SQLite's one writer connection, lent by a fair lock rather than by an sqlx pool.
//!
//! An sqlx pool takes a connection back through a task it spawns, which pings the
//! connection (on SQLite a command to the connection's thread, and its answer) before
//! the next caller may have it. With one writer, every write waited for the previous
//! write's release: a spawned task on the server's runtime, queued behind the ready
//! tasks of a loaded server, then that round trip — between every two reservation
//! batches (docs/BENCHMARKS.md, twenty-sixth session). Here the connection goes back
//! when its holder lets go, and the next in line, in the order they asked, has it at
//! once.
//!
//! A write transaction is `BEGIN IMMEDIATE` … `COMMIT` sent as statements (prepared
//! once; sqlx's own begin and commit wait for a second hand-off, measured slower). One
//! dropped before its end (an early error, a cancelled request) may still be open on
//! the connection, holding the database's write lock: it marks the connection and
//! starts a task that takes the writer at once, and whoever takes it next, that task
//! or a holder queued before it, sends `ROLLBACK` before anything else. The
//! connection's thread runs commands in the order they were sent, so that rollback
//! runs after whatever the dropped holder had sent.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::{ConnectOptions, Connection as _, Sqlite};
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use crate::backend::{Finish, PoolUsage};
use crate::error::StoreError;

/// The writer: at most one connection, opened when first needed.
#[derive(Clone)]
pub(crate) struct Writer {
    slot: Arc<Mutex<Slot>>,
    /// A transaction may still be open on the connection: its holder let go before
    /// its end. Read and written only by the holder of `slot`.
    may_be_in_transaction: Arc<AtomicBool>,
    /// Behind an `Arc`: the options are most of a backend's size, and a `Store`
    /// holds one.
    options: Arc<SqliteConnectOptions>,
    acquire_timeout: Duration,
    /// Statements run on each connection as it opens.
    session: &'static str,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Writer")
            .field("acquire_timeout", &self.acquire_timeout)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Slot {
    connection: Option<SqliteConnection>,
    closed: bool,
}

impl Writer {
    /// A writer whose connection runs `session` (statements, or nothing) when it opens.
    pub(crate) fn new(
        options: SqliteConnectOptions,
        acquire_timeout: Duration,
        session: &'static str,
    ) -> Writer {
        Writer {
            slot: Arc::new(Mutex::new(Slot::default())),
            may_be_in_transaction: Arc::new(AtomicBool::new(false)),
            options: Arc::new(options),
            acquire_timeout,
            session,
        }
    }

    /// Opens the connection now, so the first write does not pay for it (and a bad
    /// file is reported at start-up).
    pub(crate) async fn open(&self) -> Result<(), sqlx::Error> {
        self.lend().await.map(drop)
    }

    /// The connection, once the holders before have let go: within the acquire
    /// timeout (connecting included), as a pool's `acquire` answers.
    pub(crate) async fn lend(&self) -> Result<WriterConnection, sqlx::Error> {
        let lent = tokio::time::timeout(self.acquire_timeout, async {
            let mut slot = Arc::clone(&self.slot).lock_owned().await;
            if slot.closed {
                return Err(sqlx::Error::PoolClosed);
            }
            if self.may_be_in_transaction.swap(false, Ordering::Relaxed)
                && let Some(connection) = slot.connection.as_mut()
            {
                match sqlx::query("ROLLBACK").execute(connection).await {
                    // Nothing was open: the transaction had not begun, or had ended.
                    Ok(_) | Err(sqlx::Error::Database(_)) => {}
                    // The connection's thread is gone: open another below.
                    Err(_) => slot.connection = None,
                }
            }
            if slot.connection.is_none() {
                let mut connection = self.options.connect().await?;
                if !self.session.is_empty() {
                    sqlx::raw_sql(self.session).execute(&mut connection).await?;
                }
                slot.connection = Some(connection);
            }
            let connection = OwnedMutexGuard::try_map(slot, |slot| slot.connection.as_mut())
                // Not taken: the slot was filled just above.
                .map_err(|_| sqlx::Error::PoolClosed)?;
            Ok(WriterConnection {
                connection,
                writer: self.clone(),
            })
        })
        .await;
        lent.unwrap_or(Err(sqlx::Error::PoolTimedOut))
    }

    /// Lent (one) and idle (one when open and free).
    pub(crate) fn usage(&self) -> PoolUsage {
        match self.slot.try_lock() {
            Ok(slot) => PoolUsage {
                idle: u64::from(slot.connection.is_some()),
                ..PoolUsage::default()
            },
            Err(_) => PoolUsage {
                active: 1,
                ..PoolUsage::default()
            },
        }
    }

    /// Waits for the holder, closes the connection; every later `lend` is refused.
    pub(crate) async fn close(&self) {
        let mut slot = self.slot.lock().await;
        slot.closed = true;
        if let Some(connection) = slot.connection.take() {
            // Closing answers only how the close went; the connection is gone anyway.
            let _ = connection.close().await;
        }
    }
}

/// The writer's connection, lent until this is dropped.
pub struct WriterConnection {
    connection: OwnedMappedMutexGuard<Slot, SqliteConnection>,
    /// Whom to tell that a transaction may be left open.
    writer: Writer,
}

impl Deref for WriterConnection {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        &self.connection
    }
}

impl DerefMut for WriterConnection {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        &mut self.connection
    }
}

/// A write transaction on the writer, from `BEGIN IMMEDIATE` to `COMMIT`.
pub struct WriteTransaction {
    connection: WriterConnection,
    /// Set before `BEGIN` is sent and cleared once `COMMIT` or `ROLLBACK` answered, so
    /// a holder dropped in between always leaves a rollback behind.
    open: bool,
}

impl WriteTransaction {
    /// Sends `BEGIN IMMEDIATE`, which waits (up to the busy timeout) for another
    /// process's write lock.
    pub(crate) async fn begin(connection: WriterConnection) -> Result<Self, sqlx::Error> {
        let mut transaction = WriteTransaction {
            connection,
            open: true,
        };
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *transaction.connection)
            .await?;
        Ok(transaction)
    }

    /// A transaction whose `BEGIN IMMEDIATE` the caller sends as the first statement of
    /// its own first command (one hand-off to the connection's thread fewer). Open from
    /// here: dropped before its end, whatever the caller sent is rolled back.
    pub(crate) fn begun_by_first_statement(connection: WriterConnection) -> Self {
        WriteTransaction {
            connection,
            open: true,
        }
    }

    /// The connection, for statements inside the transaction.
    pub(crate) fn connection(&mut self) -> &mut SqliteConnection {
        &mut self.connection
    }

    /// The caller's last statement was `COMMIT`, and it answered: nothing is left open.
    pub(crate) fn ended_by_last_statement(mut self) {
        self.open = false;
    }

    async fn end(mut self, last: &'static str) -> Result<(), StoreError> {
        sqlx::query(last).execute(&mut *self.connection).await?;
        self.open = false;
        Ok(())
    }
}

impl Drop for WriteTransaction {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        // Still holding the lock: whoever takes it next reads the mark.
        let writer = &self.connection.writer;
        writer.may_be_in_transaction.store(true, Ordering::Relaxed);
        // Take the writer as soon as it is free, which rolls back; without a runtime
        // (only at shutdown) the next holder does.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let writer = writer.clone();
            runtime.spawn(async move {
                // A writer that is closed or busy past the timeout: whoever takes it
                // next rolls back.
                let _ = writer.lend().await;
            });
        }
    }
}

/// A SQLite transaction: on the writer, or a read on the read pool.
pub enum SqliteTransaction {
    Write(WriteTransaction),
    Read(sqlx::Transaction<'static, Sqlite>),
}

impl Deref for SqliteTransaction {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        match self {
            SqliteTransaction::Write(transaction) => &transaction.connection,
            SqliteTransaction::Read(transaction) => transaction,
        }
    }
}

impl DerefMut for SqliteTransaction {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        match self {
            SqliteTransaction::Write(transaction) => &mut transaction.connection,
            SqliteTransaction::Read(transaction) => transaction,
        }
    }
}

impl Finish for SqliteTransaction {
    async fn commit(self) -> Result<(), StoreError> {
        match self {
            SqliteTransaction::Write(transaction) => transaction.end("COMMIT").await,
            SqliteTransaction::Read(transaction) => Ok(transaction.commit().await?),
        }
    }

    async fn rollback(self) -> Result<(), StoreError> {
        match self {
            SqliteTransaction::Write(transaction) => transaction.end("ROLLBACK").await,
            SqliteTransaction::Read(transaction) => Ok(transaction.rollback().await?),
        }
    }
}

/// A SQLite connection outside a transaction: the writer's, or one of the read pool.
pub enum SqlitePooled {
    Write(WriterConnection),
    Read(PoolConnection<Sqlite>),
}

impl Deref for SqlitePooled {
    type Target = SqliteConnection;
    fn deref(&self) -> &SqliteConnection {
        match self {
            SqlitePooled::Write(connection) => connection,
            SqlitePooled::Read(connection) => connection,
        }
    }
}

impl DerefMut for SqlitePooled {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        match self {
            SqlitePooled::Write(connection) => connection,
            SqlitePooled::Read(connection) => connection,
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::str::FromStr;

    use futures_util::FutureExt;

    use super::*;
    use crate::sql::statement;

    /// A database file of the test's own, removed (with its WAL) when dropped.
    pub(crate) struct DatabaseFile(std::path::PathBuf);

    impl DatabaseFile {
        pub(crate) fn new(name: &str) -> DatabaseFile {
            DatabaseFile(
                std::env::temp_dir()
                    .join(format!("writer-unit-test-{name}-{}.db", std::process::id())),
            )
        }

        pub(crate) fn path(&self) -> &std::path::Path {
            &self.0
        }

        /// The file as a `DATABASE_URL`.
        pub(crate) fn url(&self) -> String {
            format!("sqlite://{}", self.0.display())
        }

        pub(crate) fn options(&self) -> SqliteConnectOptions {
            SqliteConnectOptions::new()
                .filename(&self.0)
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(5))
        }
    }

    impl Drop for DatabaseFile {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let mut path = self.0.clone().into_os_string();
                path.push(suffix);
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// A writer on a fresh in-memory database holding one table.
    async fn writer(acquire_timeout: Duration) -> Writer {
        let options = SqliteConnectOptions::from_str("sqlite::memory:").unwrap();
        with_table(Writer::new(options, acquire_timeout, "")).await
    }

    async fn with_table(writer: Writer) -> Writer {
        let mut connection = writer.lend().await.unwrap();
        statement("CREATE TABLE item (name TEXT NOT NULL)")
            .execute(&mut *connection)
            .await
            .unwrap();
        drop(connection);
        writer
    }

    async fn items(writer: &Writer) -> i64 {
        statement("SELECT COUNT(*) FROM item")
            .fetch_one_scalar(&mut *writer.lend().await.unwrap())
            .await
            .unwrap()
    }

    async fn insert(transaction: &mut WriteTransaction, name: &str) {
        statement("INSERT INTO item (name) VALUES ($1)")
            .bind(name)
            .execute(&mut *transaction.connection)
            .await
            .unwrap();
    }

    /// Inserts one item in a transaction of its own, committed.
    async fn commit_one(writer: &Writer, name: &str) {
        let mut transaction = WriteTransaction::begin(writer.lend().await.unwrap())
            .await
            .unwrap();
        insert(&mut transaction, name).await;
        SqliteTransaction::Write(transaction)
            .commit()
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_committed_write_stays_and_a_rolled_back_one_does_not() {
        let writer = writer(Duration::from_secs(5)).await;
        commit_one(&writer, "kept").await;
        let mut undone = WriteTransaction::begin(writer.lend().await.unwrap())
            .await
            .unwrap();
        insert(&mut undone, "undone").await;
        SqliteTransaction::Write(undone).rollback().await.unwrap();
        assert_eq!(items(&writer).await, 1);
    }

    #[tokio::test]
    async fn a_transaction_dropped_before_its_end_is_rolled_back_before_the_next_holder_writes() {
        let writer = writer(Duration::from_secs(5)).await;
        let mut dropped = WriteTransaction::begin(writer.lend().await.unwrap())
            .await
            .unwrap();
        insert(&mut dropped, "dropped").await;
        drop(dropped);
        // The next holder can begin (no transaction is left open) and sees nothing of
        // the dropped one.
        commit_one(&writer, "next").await;
        assert_eq!(items(&writer).await, 1);
    }

    #[tokio::test]
    async fn a_transaction_dropped_before_its_end_frees_the_database_for_other_processes_at_once() {
        let file = DatabaseFile::new("dropped");
        let writer = with_table(Writer::new(file.options(), Duration::from_secs(5), "")).await;
        let mut dropped = WriteTransaction::begin(writer.lend().await.unwrap())
            .await
            .unwrap();
        insert(&mut dropped, "dropped").await;
        drop(dropped);
        // Nobody takes the writer again: another connection, as another process would,
        // gets the write lock within its busy timeout only if the rollback already ran.
        let mut other = SqliteConnection::connect_with(&file.options())
            .await
            .unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap();
        let items: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM item")
            .fetch_one(&mut other)
            .await
            .unwrap();
        assert_eq!(items, 0);
        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    }

    #[tokio::test]
    async fn a_transaction_cancelled_while_its_statement_runs_leaves_the_writer_usable() {
        let writer = writer(Duration::from_secs(5)).await;
        // Polled once: the writer was free, so it was lent at once and `BEGIN
        // IMMEDIATE` went to the connection's thread, whose answer is usually not in
        // yet. Dropped there, as a cancelled request's future is. It never commits: on a
        // busy machine the one poll may get further (the thread answered before the
        // poll looked), and a `COMMIT` already sent when a future is dropped may land.
        let never_committed = async {
            let mut transaction = WriteTransaction::begin(writer.lend().await.unwrap())
                .await
                .unwrap();
            insert(&mut transaction, "cancelled").await;
            std::future::pending::<()>().await;
        };
        assert!(never_committed.now_or_never().is_none());
        commit_one(&writer, "next").await;
        assert_eq!(items(&writer).await, 1);
    }

    #[tokio::test]
    async fn a_second_holder_waits_for_the_first_and_gives_up_after_the_acquire_timeout() {
        let writer = writer(Duration::from_millis(50)).await;
        let first = writer.lend().await.unwrap();
        assert_eq!(writer.usage().active, 1);
        assert!(matches!(
            writer.lend().await.err(),
            Some(sqlx::Error::PoolTimedOut)
        ));
        drop(first);
        assert_eq!(writer.usage().idle, 1);
        assert!(writer.lend().await.is_ok());
    }

    #[tokio::test]
    async fn a_closed_writer_lends_nothing() {
        let writer = writer(Duration::from_secs(5)).await;
        writer.close().await;
        assert!(matches!(
            writer.lend().await.err(),
            Some(sqlx::Error::PoolClosed)
        ));
        assert_eq!(writer.usage().idle, 0);
    }
}
