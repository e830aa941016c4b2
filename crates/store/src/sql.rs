//! The query layer every unit of work speaks, whatever the backend.
//!
//! A unit of work builds a [`Statement`] (SQL text with `$1`, `$2`, … placeholders and
//! the values bound to them) and runs it on a [`Connection`]: the backend's own sqlx
//! connection, which binds the values with its driver, rewrites the placeholders when
//! its dialect spells them differently, classifies its errors into [`StoreError`], and
//! hands rows back as [`Row`]s of plain [`Cell`]s. Units of work are therefore written
//! once, generic over `C: Connection`, with no sqlx type in sight and no higher-ranked
//! trait bounds; everything a backend does differently sits in its `backends::…` module.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;

use futures_util::stream::BoxStream;
use futures_util::{StreamExt, TryStreamExt};

use crate::error::StoreError;

/// SQL text: a literal in the source (the common case, passed to the driver without a
/// copy) or text assembled at run time (a filter chosen by the caller).
#[derive(Debug, Clone)]
pub enum Text {
    Static(&'static str),
    Built(String),
}

/// A value bound to a placeholder. A NULL keeps its type: PostgreSQL types every
/// parameter, and an untyped NULL would not fit an integer column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value<'q> {
    Integer(Option<i64>),
    Text(Option<Cow<'q, str>>),
}

/// What can be bound to a placeholder.
pub trait IntoValue<'q> {
    fn into_value(self) -> Value<'q>;
}

impl<'q> IntoValue<'q> for i64 {
    fn into_value(self) -> Value<'q> {
        Value::Integer(Some(self))
    }
}

impl<'q> IntoValue<'q> for &i64 {
    fn into_value(self) -> Value<'q> {
        Value::Integer(Some(*self))
    }
}

impl<'q> IntoValue<'q> for Option<i64> {
    fn into_value(self) -> Value<'q> {
        Value::Integer(self)
    }
}

impl<'q> IntoValue<'q> for &'q str {
    fn into_value(self) -> Value<'q> {
        Value::Text(Some(Cow::Borrowed(self)))
    }
}

impl<'q> IntoValue<'q> for &'q String {
    fn into_value(self) -> Value<'q> {
        Value::Text(Some(Cow::Borrowed(self.as_str())))
    }
}

impl<'q> IntoValue<'q> for String {
    fn into_value(self) -> Value<'q> {
        Value::Text(Some(Cow::Owned(self)))
    }
}

impl<'q> IntoValue<'q> for Option<&'q str> {
    fn into_value(self) -> Value<'q> {
        Value::Text(self.map(Cow::Borrowed))
    }
}

impl<'q> IntoValue<'q> for Option<String> {
    fn into_value(self) -> Value<'q> {
        Value::Text(self.map(Cow::Owned))
    }
}

/// One statement and its values, ready to run on any backend's connection.
#[derive(Debug, Clone)]
#[must_use = "a statement does nothing until it runs on a connection"]
pub struct Statement<'q> {
    pub text: Text,
    pub values: Vec<Value<'q>>,
}

/// What the statement layer keeps of a statement while it runs: enough to time it as a
/// lock wait and to name it in a deadlock's error, without copying its text.
#[derive(Debug, Clone, Copy)]
pub struct Described {
    text: Option<&'static str>,
    takes_row_locks: bool,
}

impl Described {
    pub fn of(statement: &Statement<'_>) -> Described {
        let (text, takes_row_locks) = match &statement.text {
            Text::Static(text) => (Some(*text), crate::observe::takes_row_locks(text)),
            Text::Built(text) => (None, crate::observe::takes_row_locks(text)),
        };
        Described {
            text,
            takes_row_locks,
        }
    }

    /// A statement the backend runs through sqlx itself (arrays, functions), known to
    /// take row locks.
    pub fn locking(text: &'static str) -> Described {
        Described {
            text: Some(text),
            takes_row_locks: true,
        }
    }

    /// Runs the statement's future, timed as a lock wait when it takes row locks.
    pub async fn run<Output>(self, statement: impl Future<Output = Output>) -> Output {
        if !self.takes_row_locks {
            return statement.await;
        }
        let started = std::time::Instant::now();
        let output = statement.await;
        crate::observe::record_lock_wait(started.elapsed());
        output
    }

    /// The error of the statement, a deadlock naming the statement it broke.
    pub fn explain(self, error: sqlx::Error) -> StoreError {
        match StoreError::from(error) {
            StoreError::Deadlock(message) => StoreError::Deadlock(format!(
                "{message}; statement: {}",
                self.text.unwrap_or("(built at run time)")
            )),
            other => other,
        }
    }
}

/// A statement from literal SQL text.
pub fn statement<'q>(text: &'static str) -> Statement<'q> {
    Statement {
        text: Text::Static(text),
        values: Vec::new(),
    }
}

/// A statement from SQL text assembled at run time. The text must never contain a
/// caller's input: every input is bound as a value.
pub fn built_statement<'q>(text: String) -> Statement<'q> {
    Statement {
        text: Text::Built(text),
        values: Vec::new(),
    }
}

impl<'q> Statement<'q> {
    pub fn bind(mut self, value: impl IntoValue<'q>) -> Statement<'q> {
        self.values.push(value.into_value());
        self
    }

    /// Runs the statement; answers how many rows it changed (for MySQL: matched).
    pub async fn execute<C: Connection>(self, connection: &mut C) -> Result<u64, StoreError> {
        connection.execute(self).await
    }

    pub async fn fetch_all_rows<C: Connection>(
        self,
        connection: &mut C,
    ) -> Result<Vec<Row>, StoreError> {
        connection.fetch_all(self).await
    }

    pub async fn fetch_optional_row<C: Connection>(
        self,
        connection: &mut C,
    ) -> Result<Option<Row>, StoreError> {
        connection.fetch_optional(self).await
    }

    pub async fn fetch_one_row<C: Connection>(self, connection: &mut C) -> Result<Row, StoreError> {
        connection.fetch_optional(self).await?.ok_or_else(|| {
            StoreError::Database("a statement that returns a row returned none".into())
        })
    }

    pub async fn fetch_all_as<T: FromRow>(
        self,
        connection: &mut impl Connection,
    ) -> Result<Vec<T>, StoreError> {
        connection
            .fetch_all(self)
            .await?
            .iter()
            .map(T::from_row)
            .collect()
    }

    pub async fn fetch_optional_as<T: FromRow>(
        self,
        connection: &mut impl Connection,
    ) -> Result<Option<T>, StoreError> {
        connection
            .fetch_optional(self)
            .await?
            .as_ref()
            .map(T::from_row)
            .transpose()
    }

    pub async fn fetch_one_as<T: FromRow>(
        self,
        connection: &mut impl Connection,
    ) -> Result<T, StoreError> {
        T::from_row(&self.fetch_one_row(connection).await?)
    }

    /// The first column of every row.
    pub async fn fetch_all_scalar<T: FromCell>(
        self,
        connection: &mut impl Connection,
    ) -> Result<Vec<T>, StoreError> {
        connection
            .fetch_all(self)
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect()
    }

    /// The first column of the first row, if there is a row.
    pub async fn fetch_optional_scalar<T: FromCell>(
        self,
        connection: &mut impl Connection,
    ) -> Result<Option<T>, StoreError> {
        connection
            .fetch_optional(self)
            .await?
            .map(|row| row.try_get(0))
            .transpose()
    }

    /// The first column of the one row the statement returns.
    pub async fn fetch_one_scalar<T: FromCell>(
        self,
        connection: &mut impl Connection,
    ) -> Result<T, StoreError> {
        self.fetch_one_row(connection).await?.try_get(0)
    }

    /// The rows one at a time, for results too large to hold at once (the audit).
    pub fn fetch_as<'a, T: FromRow + Send + 'a>(
        self,
        connection: &'a mut impl Connection,
    ) -> BoxStream<'a, Result<T, StoreError>>
    where
        'q: 'a,
    {
        connection
            .fetch_stream(self)
            .map(|row| row.and_then(|row| T::from_row(&row)))
            .boxed()
    }
}

/// One column's value as read: integers, text and NULL are all a unit of work stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cell {
    Null,
    Integer(i64),
    Text(String),
}

/// A row as read, columns by position and by name.
#[derive(Debug, Clone)]
pub struct Row {
    pub names: Arc<[String]>,
    pub cells: Vec<Cell>,
}

/// A column named by position or by name.
pub trait ColumnIndex {
    fn position(&self, row: &Row) -> Result<usize, StoreError>;
}

impl ColumnIndex for usize {
    fn position(&self, row: &Row) -> Result<usize, StoreError> {
        if *self < row.cells.len() {
            Ok(*self)
        } else {
            Err(StoreError::Database(format!(
                "column {self} of a row of {} columns",
                row.cells.len()
            )))
        }
    }
}

impl ColumnIndex for &str {
    fn position(&self, row: &Row) -> Result<usize, StoreError> {
        row.names
            .iter()
            .position(|name| name == self)
            .ok_or_else(|| StoreError::Database(format!("no column named {self}")))
    }
}

impl Row {
    pub fn try_get<T: FromCell, I: ColumnIndex>(&self, index: I) -> Result<T, StoreError> {
        let position = index.position(self)?;
        T::from_cell(&self.cells[position]).map_err(|expected| {
            StoreError::Database(format!(
                "column {} holds {:?}, expected {expected}",
                self.names.get(position).map(String::as_str).unwrap_or("?"),
                self.cells[position]
            ))
        })
    }
}

/// A Rust value read from one cell; the error names what was expected.
pub trait FromCell: Sized {
    fn from_cell(cell: &Cell) -> Result<Self, &'static str>;
}

impl FromCell for i64 {
    fn from_cell(cell: &Cell) -> Result<i64, &'static str> {
        match cell {
            Cell::Integer(value) => Ok(*value),
            _ => Err("an integer"),
        }
    }
}

impl FromCell for String {
    fn from_cell(cell: &Cell) -> Result<String, &'static str> {
        match cell {
            Cell::Text(value) => Ok(value.clone()),
            _ => Err("text"),
        }
    }
}

impl<T: FromCell> FromCell for Option<T> {
    fn from_cell(cell: &Cell) -> Result<Option<T>, &'static str> {
        match cell {
            Cell::Null => Ok(None),
            other => T::from_cell(other).map(Some),
        }
    }
}

/// A Rust value read from a whole row: tuples, column by column.
pub trait FromRow: Sized {
    fn from_row(row: &Row) -> Result<Self, StoreError>;
}

macro_rules! tuple_from_row {
    ($($position:tt $name:ident),+) => {
        impl<$($name: FromCell),+> FromRow for ($($name,)+) {
            fn from_row(row: &Row) -> Result<Self, StoreError> {
                Ok(($(row.try_get::<$name, _>($position)?,)+))
            }
        }
    };
}

tuple_from_row!(0 A);
tuple_from_row!(0 A, 1 B);
tuple_from_row!(0 A, 1 B, 2 C);
tuple_from_row!(0 A, 1 B, 2 C, 3 D);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E, 5 F);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E, 5 F, 6 G);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E, 5 F, 6 G, 7 H);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E, 5 F, 6 G, 7 H, 8 I);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E, 5 F, 6 G, 7 H, 8 I, 9 J);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E, 5 F, 6 G, 7 H, 8 I, 9 J, 10 K);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E, 5 F, 6 G, 7 H, 8 I, 9 J, 10 K, 11 L);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E, 5 F, 6 G, 7 H, 8 I, 9 J, 10 K, 11 L, 12 M);
tuple_from_row!(0 A, 1 B, 2 C, 3 D, 4 E, 5 F, 6 G, 7 H, 8 I, 9 J, 10 K, 11 L, 12 M, 13 N);

/// A database connection of one backend: runs statements in its dialect. Implemented by
/// each backend for its sqlx connection type (a transaction or a pooled connection
/// dereferences to it), in that backend's module.
pub trait Connection: Send + Sized {
    fn execute<'a>(
        &'a mut self,
        statement: Statement<'a>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    fn fetch_all<'a>(
        &'a mut self,
        statement: Statement<'a>,
    ) -> impl Future<Output = Result<Vec<Row>, StoreError>> + Send + 'a;

    fn fetch_optional<'a>(
        &'a mut self,
        statement: Statement<'a>,
    ) -> impl Future<Output = Result<Option<Row>, StoreError>> + Send + 'a;

    fn fetch_stream<'a>(
        &'a mut self,
        statement: Statement<'a>,
    ) -> BoxStream<'a, Result<Row, StoreError>>;

    /// Runs several statements of literal SQL with no values (a migration).
    fn execute_script<'a>(
        &'a mut self,
        script: &'static str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;
}

/// Reads a whole result into rows, sharing one list of column names.
pub(crate) fn rows_of<R>(
    found: Vec<R>,
    cell: impl Fn(&R, usize) -> Result<Cell, StoreError>,
) -> Result<Vec<Row>, StoreError>
where
    R: sqlx::Row,
{
    let mut names: Option<Arc<[String]>> = None;
    found
        .iter()
        .map(|row| row_of(row, &mut names, &cell))
        .collect()
}

/// Reads one row, reusing the column names of the rows before it.
pub(crate) fn row_of<R>(
    row: &R,
    names: &mut Option<Arc<[String]>>,
    cell: impl Fn(&R, usize) -> Result<Cell, StoreError>,
) -> Result<Row, StoreError>
where
    R: sqlx::Row,
{
    use sqlx::Column;
    let names = names
        .get_or_insert_with(|| {
            row.columns()
                .iter()
                .map(|column| column.name().to_owned())
                .collect()
        })
        .clone();
    let cells = (0..row.len())
        .map(|position| cell(row, position))
        .collect::<Result<Vec<Cell>, StoreError>>()?;
    Ok(Row { names, cells })
}

/// A stream of sqlx rows as a stream of [`Row`]s.
pub(crate) fn stream_of<'a, R>(
    rows: BoxStream<'a, Result<R, StoreError>>,
    cell: fn(&R, usize) -> Result<Cell, StoreError>,
) -> BoxStream<'a, Result<Row, StoreError>>
where
    R: sqlx::Row + 'a,
{
    let mut names: Option<Arc<[String]>> = None;
    rows.map_ok(move |row| row_of(&row, &mut names, cell))
        .map(|result| result.and_then(|row| row))
        .boxed()
}

/// Binds a statement's values to an sqlx query, in order.
pub(crate) fn text_of(text: Text) -> sqlx::SqlStr {
    use sqlx::SqlSafeStr;
    match text {
        Text::Static(text) => text.into_sql_str(),
        Text::Built(text) => sqlx::AssertSqlSafe(text).into_sql_str(),
    }
}

/// Implements [`Connection`] for an sqlx connection type whose driver takes the
/// statements as written: `$query_of` turns a [`Statement`] into the driver's query,
/// `$cell` reads one column of the driver's row. (MySQL, which rewrites statements and
/// reads duplicate keys as "nothing written", has its own implementation.)
macro_rules! connection_as_written {
    ($connection:ty, $query_of:path, $cell:path) => {
        impl $crate::sql::Connection for $connection {
            async fn execute<'a>(
                &'a mut self,
                statement: $crate::sql::Statement<'a>,
            ) -> Result<u64, $crate::error::StoreError> {
                let described = $crate::sql::Described::of(&statement);
                Ok(described
                    .run($query_of(statement).execute(&mut *self))
                    .await
                    .map_err(|error| described.explain(error))?
                    .rows_affected())
            }

            async fn fetch_all<'a>(
                &'a mut self,
                statement: $crate::sql::Statement<'a>,
            ) -> Result<Vec<$crate::sql::Row>, $crate::error::StoreError> {
                let described = $crate::sql::Described::of(&statement);
                let found = described
                    .run($query_of(statement).fetch_all(&mut *self))
                    .await
                    .map_err(|error| described.explain(error))?;
                $crate::sql::rows_of(found, $cell)
            }

            async fn fetch_optional<'a>(
                &'a mut self,
                statement: $crate::sql::Statement<'a>,
            ) -> Result<Option<$crate::sql::Row>, $crate::error::StoreError> {
                let described = $crate::sql::Described::of(&statement);
                let found = described
                    .run($query_of(statement).fetch_optional(&mut *self))
                    .await
                    .map_err(|error| described.explain(error))?;
                Ok($crate::sql::rows_of(found.into_iter().collect(), $cell)?.pop())
            }

            fn fetch_stream<'a>(
                &'a mut self,
                statement: $crate::sql::Statement<'a>,
            ) -> futures_util::stream::BoxStream<
                'a,
                Result<$crate::sql::Row, $crate::error::StoreError>,
            > {
                use futures_util::{StreamExt, TryStreamExt};
                let rows = $query_of(statement)
                    .fetch(self)
                    .map_err($crate::error::StoreError::from)
                    .boxed();
                $crate::sql::stream_of(rows, $cell)
            }

            async fn execute_script(
                &mut self,
                script: &'static str,
            ) -> Result<(), $crate::error::StoreError> {
                sqlx::raw_sql(script).execute(&mut *self).await?;
                Ok(())
            }
        }
    };
}
pub(crate) use connection_as_written;
