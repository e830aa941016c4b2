//! The strategy lab: read-check-write oversells (that is the point), the three safe
//! strategies never do — on SQLite and PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use acceptance::{Backend, mirrored_tests, mysql_url, postgres_url};
use lab::strategies::{LAST_UNIT, LIMITED, LabDatabase, Strategy, run};

mirrored_tests!(
    read_check_write_oversells_under_contention,
    the_safe_strategies_never_oversell,
);

/// Drops the lab's scratch schema or file.
async fn close(database: Arc<LabDatabase>) {
    if let Ok(database) = Arc::try_unwrap(database) {
        database.close().await;
    }
}

async fn database(backend: Backend) -> Arc<LabDatabase> {
    let url = match backend {
        Backend::Sqlite => "sqlite".to_owned(),
        Backend::Postgres => postgres_url(),
        Backend::Mysql => mysql_url(),
    };
    Arc::new(LabDatabase::open(&url).await.unwrap())
}

/// Runs that happen not to race are possible in principle; a few attempts make the
/// demonstration reliable without weakening what it shows.
const UNSAFE_ATTEMPTS_MAX: usize = 5;

async fn read_check_write_oversells_under_contention(backend: Backend) {
    let database = database(backend).await;
    let mut runs = Vec::new();
    for _ in 0..UNSAFE_ATTEMPTS_MAX {
        let result = run(
            &database,
            Strategy::ReadCheckWrite,
            LAST_UNIT,
            Duration::from_millis(1),
        )
        .await
        .unwrap();
        let oversold = result.oversold_visibly();
        runs.push(result);
        if oversold {
            break;
        }
    }
    close(database).await;
    let last = runs.last().unwrap();
    assert!(
        last.oversold_visibly(),
        "read-check-write never oversold in {} runs: {runs:?}",
        runs.len()
    );
    assert!(last.successes > 1);
    assert_eq!(
        last.final_available, 0,
        "the counter looks fine: the oversell is invisible to it"
    );
    assert_eq!(last.deduction_records as u64, last.successes);
}

async fn the_safe_strategies_never_oversell(backend: Backend) {
    let database = database(backend).await;
    let mut results = Vec::new();
    for case in [LAST_UNIT, LIMITED] {
        for strategy in [
            Strategy::SelectForUpdate,
            Strategy::ConditionalUpdate,
            Strategy::OptimisticVersion,
        ] {
            let result = run(&database, strategy, case, Duration::from_millis(1))
                .await
                .unwrap();
            results.push((case, strategy, result));
        }
    }
    close(database).await;
    for (case, strategy, result) in results {
        assert_eq!(result.oversold, 0, "{result:?}");
        assert!(result.successes as i64 <= case.stock, "{result:?}");
        assert_eq!(
            result.final_available,
            case.stock - result.successes as i64,
            "{result:?}"
        );
        assert_eq!(
            result.deduction_records, result.successes as i64,
            "{result:?}"
        );
        if strategy != Strategy::OptimisticVersion {
            assert_eq!(
                result.successes as i64, case.stock,
                "a locking strategy sells all it has: {result:?}"
            );
        }
    }
}
