//! MySQL/MariaDB: its assignment order, and the shared SQL store tests in its dialect.

/// `renew` (an `UPDATE`) and `begin` rely on MySQL applying assignments left to right. On
/// a MariaDB whose global `sql_mode` has `SIMULTANEOUS_ASSIGNMENT` (an `UPDATE`'s
/// assignments all see the old row) the store's connections turn it off.
#[test]
fn simultaneous_assignment_on_the_server_does_not_break_the_store() {
    use idem_testkit::services::{SqlKind, SqlServer};
    if MYSQL.url().is_none() {
        return;
    }
    let Some(server) = SqlServer::start(SqlKind::MariaDb) else {
        return;
    };
    idem_testkit::block_on(async {
        let mut admin = <sqlx::MySqlConnection as sqlx::Connection>::connect(&server.url())
            .await
            .unwrap();
        sqlx::query("SET GLOBAL sql_mode = CONCAT(@@GLOBAL.sql_mode, ',SIMULTANEOUS_ASSIGNMENT')")
            .execute(&mut admin)
            .await
            .unwrap();
        // A fresh connection gets the mode from the server's global setting.
        let mut plain = <sqlx::MySqlConnection as sqlx::Connection>::connect(&server.url())
            .await
            .unwrap();
        let mode: String = sqlx::query_scalar("SELECT @@SESSION.sql_mode")
            .fetch_one(&mut plain)
            .await
            .unwrap();
        assert!(mode.contains("SIMULTANEOUS_ASSIGNMENT"), "{mode}");
        let store = MySqlStore::connect(&server.url()).await.unwrap();
        idem_testkit::conformance::expired_lease_is_taken_over_with_higher_fence(&store).await;
        idem_testkit::conformance::release_gives_the_key_back(&store).await;
        idem_testkit::conformance::renew_extends_the_lease(&store).await;
    });
}

sql_store_tests! {
    store: MySqlStore,
    options: MySqlOptions,
    service: MYSQL,
    unreachable: "mysql://root@127.0.0.1:1/test",
    schema: "test",
    own_server: MariaDb,
    ledger: "CREATE TABLE {} (transfer VARCHAR(64) NOT NULL) ENGINE = InnoDB",
    insert: "INSERT INTO {} (transfer) VALUES (?)",
    count: "SELECT COUNT(*) FROM {} WHERE transfer = ?",
    versions: [1, 2, 3],
}
